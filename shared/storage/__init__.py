"""Where things live: the object store (a local folder or S3), the key layout of a job, and the sample file
format. A leaf: it imports nothing of the job lifecycle."""
