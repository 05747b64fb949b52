"""π0 / π0.5 (work in progress; registered once the port lands)."""
