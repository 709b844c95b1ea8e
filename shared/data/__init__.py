"""What goes into a job: datasets, chat tokenization, the draft vocabulary, the model's files and the prompt mixes
built from installed packages. A leaf: it imports nothing of the job lifecycle."""
