"""The load tester's commands, summaries and verdicts."""
