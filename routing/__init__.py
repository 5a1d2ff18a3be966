"""Which backend serves a session: affinity, least-loaded placement, failover."""
