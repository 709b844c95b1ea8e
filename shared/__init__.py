"""The library every service imports. Settings, errors and access rules at the top; the packages beside them:
lifecycle (jobs, kinds, shards, leases, recovery, progress), capture, storage, data and ops."""

__version__ = "0.1.0"
