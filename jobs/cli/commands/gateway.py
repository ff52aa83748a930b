"""``slotq gateway``: the HTTP gateway (:mod:`slotq.jobs.gateway.server`) with the settings its flags give."""

from __future__ import annotations

import argparse

from slotq.jobs.settings import from_command_line


def cmd_gateway(args: argparse.Namespace) -> None:
    from slotq.jobs.gateway.server import serve
    from slotq.jobs.gateway.settings import GatewaySettings

    serve(from_command_line(GatewaySettings, args, args.settings_source))
