"""Deployment on a Franka arm: a websocket policy server, the robot client loop with a safety
layer, real and simulated backends, and episode recording (see docs/deploy.md).

- :mod:`.codec` / :mod:`.protocol`: the wire format and the handshake metadata.
- :mod:`.server` (``rlinf-vla serve``, :mod:`.serve`) and :mod:`.client`.
- :mod:`.safety`: pure numpy checks and the :class:`~.safety.SafetyFilter` chain, the e-stop.
- :mod:`.robot` (the interface), :mod:`.sim` (MuJoCo Panda), :mod:`.franka` (franky + RealSense).
- :mod:`.deploy` (``rlinf-vla deploy``) and :mod:`.recording` (the on-disk episode format).

Nothing heavy is imported here: MuJoCo, franky, pyrealsense2 and websockets load when used.
"""
