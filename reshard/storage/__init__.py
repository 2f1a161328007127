"""Where checkpoints live: staging, atomic commit and the manifest."""
