"""Data: sources, the decoded-data cache, the task stream, partitions and splits."""
