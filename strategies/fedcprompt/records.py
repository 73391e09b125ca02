"""What Fed-CPrompt adds to the wire."""

#: config key of a train message: how many task slices the server knows (0..known-1)
KNOWN_TASKS = "known-tasks"
