"""Command-line tools around the engine: demo, bench, profile, soak (``graphcp CMD``)."""
