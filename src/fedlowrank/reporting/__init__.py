"""What a run reports while and after it runs: progress lines and bars, experiment trackers, a run's plots."""
