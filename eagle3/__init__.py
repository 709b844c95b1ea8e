"""The composition root: the `eagle3` command line, the demo and the local stack. The only package that wires several
services together; `services/*` never import each other, and `shared/` holds no process concerns."""
