"""Which vLLM servers a collected session will start, and what its start-ups cost once it ran.

Every server costs a start-up (26 to 61 s on 2 cores, docs/servers.md), so each must earn it. The plan is
read from the collected tests, before anything starts: a test that uses `kv_server` (or `kv_measure`, or
carries the `server` marker) starts its `kv_backend`'s server; a test that starts others says so with
`@pytest.mark.kv_servers(NAME, ...)`, whose names may hold `{backend}` (the test's kv_backend) and `{ab}`
(both backends of --kv-ab). `--kv-server-plan` prints the plan and runs nothing; the end of a run compares
the servers it started with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = "kv_servers"
MARKER_HELP = ("kv_servers(NAME, ...): the servers this test starts ({backend}: its kv_backend, {ab}: the "
               "--kv-ab pair); counted by --kv-server-plan")
STARTING_FIXTURES = ("kv_server", "kv_measure")


def base_name(server: str) -> str:
    """The registered backend a server's name derives from (variants NAME[...], A/B twins NAME~b)."""
    return server.partition("[")[0].partition("~")[0]


def item_servers(item, ab: tuple[str, str] | None) -> list[str]:
    """The servers one collected test starts (possibly none)."""
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("kv_backend") if callspec else None
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        names = []
        for pattern in marker.args:
            if "{ab}" in pattern:
                names += [pattern.replace("{ab}", name) for name in (ab or ())]
            elif "{backend}" in pattern:
                if backend is not None:
                    names.append(pattern.replace("{backend}", backend))
            else:
                names.append(pattern)
        return names
    uses = set(getattr(item, "fixturenames", ())) & set(STARTING_FIXTURES)
    if backend is not None and (uses or item.get_closest_marker("server") is not None):
        return [backend]
    return []


@dataclass
class Plan:
    servers: dict[str, list[str]]  # server name -> the node ids of the tests that start it

    def lines(self) -> list[str]:
        out = [f"kvoffload: {len(self.servers)} servers planned"]
        for name, nodes in self.servers.items():
            more = f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""
            out.append(f"  {name}: {nodes[0]}{more}")
        return out


def plan(items, available, ab: tuple[str, str] | None = None) -> Plan:
    """The servers the collected `items` will start, in the order the first test of each runs.
    `available(backend_name)` says whether this machine can run a registered backend (others skip)."""
    servers: dict[str, list[str]] = {}
    for item in items:
        for name in item_servers(item, ab):
            if available(base_name(name)):
                servers.setdefault(name, []).append(item.nodeid)
    return Plan(servers)


def startup_line(starts: list[tuple[str, float]], planned: Plan | None) -> str:
    """The closing line on start-ups: how many, their total and spread, and any server nobody planned."""
    if not starts:
        return "server start-ups: none"
    seconds = [s for _, s in starts]
    names = [n for n, _ in starts]
    restarts = len(names) - len(set(names))
    line = (f"server start-ups: {len(starts)} ({len(set(names))} servers"
            + (f", {restarts} restarted" if restarts else "")
            + f"), {sum(seconds):.0f} s in all; first {seconds[0]:.0f} s, later "
            + (f"{min(seconds[1:]):.0f} to {max(seconds[1:]):.0f} s" if len(seconds) > 1 else "none"))
    if planned is not None:
        unplanned = sorted(set(names) - set(planned.servers))
        line += f"; planned {len(planned.servers)}"
        if unplanned:
            line += f"; NOT PLANNED (mark the test kv_servers): {', '.join(unplanned)}"
    return line
