"""What operators read: the cluster's workers and queue, a job's timeline, dead letters, and the doctor's
checks. It reads the lifecycle; the lifecycle never imports it."""
