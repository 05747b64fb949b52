"""openvla_oft policy family."""
