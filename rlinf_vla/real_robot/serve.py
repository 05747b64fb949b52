"""``rlinf-vla serve``: load a registered policy and serve it over websockets::

rlinf-vla serve policy=openvla_oft policy.checkpoint=runs/<run>/checkpoints/iter_10/policy
rlinf-vla serve policy=pi0 policy.preset=tiny server.port=8001 server.token=$TOKEN
rlinf-vla serve policy=openvla_oft --cfg job        # print the resolved config
rlinf-vla serve policy=pi0 server.protocol=openpi server.openpi_layout=libero   # openpi clients
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

from rlinf_vla.config import ConfigError, check_sections, from_section, named_section
from rlinf_vla.real_robot.openpi import check_layout, describe
from rlinf_vla.real_robot.server import PolicyServer, ServerConfig, is_loopback

__all__ = ["ServeJob", "run", "validate"]


@dataclass
class ServeJob:
    """A validated ``rlinf-vla serve`` job: ``policy`` holds the keys the command line set,
    ``policy_config`` the typed config the policy is built from (with a checkpoint, the
    checkpoint's config under those keys)."""

    policy_name: str
    policy: dict[str, Any]
    server: ServerConfig = field(default_factory=ServerConfig)
    policy_config: Any = None


def validate(cfg: Any) -> ServeJob:
    """Check the composed ``serve`` config (policy name, keys, server limits); pure."""
    from omegaconf import OmegaConf

    from rlinf_vla.policies.resolve import policy_config_for

    values = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    check_sections(values, ("policy", "server"))
    name, policy = named_section(values.get("policy") or {}, "policy")
    config = policy_config_for(name, policy)  # reads a checkpoint's config files
    server = from_section(ServerConfig, values.get("server"), "server")
    if server.protocol == "openpi":
        try:
            check_layout(server.openpi_layout, config.needs().cameras)
        except ValueError as e:
            raise ConfigError(f"server.openpi_layout: {e}") from None
    return ServeJob(name, policy, server, config)


def run(job: ServeJob) -> None:
    """Load the policy and serve until interrupted."""
    from rich.console import Console

    from rlinf_vla.policies import make_policy

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    console = Console()
    with console.status(f"loading policy {job.policy_name}..."):
        policy = make_policy(job.policy_name, job.policy_config).eval()
    server = PolicyServer(policy, job.policy_name, job.server)
    meta = server.metadata
    console.print(
        f"policy {meta.policy}: cameras {list(meta.image_keys)} ({meta.image_size} px), "
        f"state_dim {meta.state_dim}, action_dim {meta.action_dim}, chunk {meta.chunk_size}, "
        f"{meta.control_rate_hz} Hz; token {'on' if job.server.token else 'off'}"
    )
    if job.server.protocol == "openpi":
        console.print(
            f"protocol openpi, layout {job.server.openpi_layout}: "
            f"{describe(job.server.openpi_layout, meta.image_keys)}"
        )
    if not is_loopback(job.server.host) and not job.server.token:  # allow_unauthenticated
        console.print("[yellow]warning:[/] serving beyond localhost without server.token")
    with console.status("warming up (first act call)..."):
        server.warmup()

    async def serve_until_signal() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop=stop)

    try:
        asyncio.run(serve_until_signal())
    except OSError as e:  # the address is taken, or not this machine's
        raise ConfigError(
            f"server.host={job.server.host} server.port={job.server.port}: cannot listen there "
            f"({e.strerror or e}); choose another server.port (0: any free one)"
        ) from None
    console.print(f"stopped; served {server.stats}")
