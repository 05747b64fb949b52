"""openvla policy family."""
