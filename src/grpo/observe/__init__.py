"""What a run shows: metrics and trackers, the console and log lines, diagnostics, callbacks, the run
directory, and the run report (`report/`)."""
