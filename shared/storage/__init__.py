"""Where things live: the object store (a local folder or S3), the key layout of a job, the sample file format,
and files named by a path or URL. A leaf: it imports nothing of the job lifecycle."""
