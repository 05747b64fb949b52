"""pi0 policy family."""
