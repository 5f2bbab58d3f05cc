"""What several commands share: the service names, the exit code of a bad config, and arguments parsed the same
way everywhere (ports, the ``--tls-*`` flags of commands that dial a service by address)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from relayrl.config.tls import TlsConfig

SERVICES = ("inference", "reward", "rollout", "trainer")
EXIT_CONFIG = 2  # a config error (named field, value and rule) was printed


def run_target(text: str) -> Any:
    """The run folder or run config file ``text`` names (relayrl.status.Target, with its config); None, with the
    reason printed, when it is neither."""
    from relayrl.status import resolve

    target = resolve(text)
    if target.cfg is None:
        print(f"relayrl: {text} is not a run folder or config file", file=sys.stderr)
        return None
    return target


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def add_overrides(p: argparse.ArgumentParser, help_text: str = "override a config value (repeatable)") -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help_text)


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """TLS of a command that dials a service by address (a run folder or config brings its own ``tls`` section)."""
    p.add_argument(
        "--tls-ca",
        default="",
        metavar="FILE",
        help="PEM CA to verify the server against: dial with TLS (a run folder/config: its tls section)",
    )
    p.add_argument("--tls-cert", default="", metavar="FILE", help="PEM client certificate to present (mutual TLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-server-name",
        default="",
        metavar="NAME",
        help="name expected in the server certificate instead of the target's host",
    )


def tls(args: argparse.Namespace) -> TlsConfig | None:
    """The ``tls`` section the ``--tls-*`` flags describe (None when none is given). Raises ConfigError."""
    from relayrl.config.typed import from_dict

    values = {
        "ca_file": args.tls_ca,
        "client_cert_file": args.tls_cert,
        "client_key_file": args.tls_key,
        "server_name": args.tls_server_name,
    }
    if not any(values.values()):
        return None
    section = from_dict(TlsConfig, {k: v for k, v in values.items() if v}, "tls")
    section.read()  # a missing or non-PEM file is a config error naming the field, not a failed handshake
    return section


def resume_override(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides plus ``--resume`` as trainer.checkpoint.resume."""
    return [*args.overrides, *([f"trainer.checkpoint.resume={args.resume}"] if args.resume else [])]
