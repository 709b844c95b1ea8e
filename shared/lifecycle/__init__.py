"""The job and shard lifecycle: jobs and their kinds, shard claims and commits (exactly once), leases, recovery of
dead workers, the queue and the progress counters. Everything here may use the packages beside it; none uses this."""
