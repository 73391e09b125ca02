"""A node's resources: its memory plan and footprint, identity and start-up phases."""
