"""The capture protocol every inference backend speaks (requests, checks, the tensor hand-off) and the workers'
client for it. A leaf: it imports nothing of the job lifecycle."""
