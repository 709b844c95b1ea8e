"""The chaos soak (`make soak`): jobs of both kinds submitted over time while faults drawn from the fault suite's
scenarios are injected at seeded random times; every job must end completed (or deleted, for those the soak
deletes) with a clean audit, and the stack's resources must stay bounded. Not collected by pytest (no test_ files
here): `python -m tests.soak --minutes N --seed S`."""
