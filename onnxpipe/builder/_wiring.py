"""What feeds what in a :class:`~onnxpipe.builder.PipelineConfig`: its links and its state links, each
destination fed once, and the order of the stages they give."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnxpipe._errors import ConfigError
from onnxpipe.runtime import Endpoint, Link, StateLink, StepFlag

__all__ = ["Wiring"]


class Wiring:
    """The links of a config, by destination, and its state links, by the input they feed.

    Attributes:
        links: Destination (a stage input or a pipeline output) -> the link that feeds it.
        states: State input -> the state link that feeds it on a stream's next step.
        flags: Stage input -> the step flag the runtime feeds it by a stream's step.
    """

    def __init__(self) -> None:
        self.links: dict[Endpoint, Link] = {}
        self.states: dict[Endpoint, StateLink] = {}
        self.flags: dict[Endpoint, StepFlag] = {}

    def check_free(self, dst: Endpoint, what: str) -> None:
        """Refuse a second feed of ``dst``; ``what`` begins the message (``stage 'b' input 'x'``).

        Raises:
            ConfigError: a link or a state link already feeds ``dst``, naming it.
        """
        if dst in self.links:
            raise ConfigError(f"{what} is already fed by {self.links[dst].src}")
        if dst in self.states:
            raise ConfigError(f"{what} is already fed by state {self.states[dst].output}")
        if dst in self.flags:
            raise ConfigError(f"{what} is already fed by the runtime as a step flag")

    def add_link(self, link: Link) -> None:
        """Record a link (its destination checked free with :meth:`check_free`)."""
        self.links[link.dst] = link

    def add_state(self, link: StateLink) -> None:
        """Record a state link (its input checked free with :meth:`check_free`)."""
        self.states[Endpoint(link.stage, link.input)] = link

    def add_flag(self, flag: StepFlag) -> None:
        """Record a step flag (its input checked free with :meth:`check_free`)."""
        self.flags[Endpoint(flag.stage, flag.input)] = flag

    def feed(self, dst: Endpoint) -> str:
        """What feeds ``dst``, as a config's text shows it: a source, a state, or ``UNBOUND``."""
        if dst in self.links:
            return str(self.links[dst].src)
        if dst in self.states:
            return f"state {self.states[dst].output} (first step)" if self.states[dst].once else f"state {self.states[dst].output} (previous step)"
        if dst in self.flags:
            return f"step flag ({self.flags[dst].first} on a stream's first step)"
        return "UNBOUND"

    def targets(self) -> dict[Endpoint, list[Endpoint]]:
        """Source -> the destinations its links feed, in the order they were linked."""
        by_src: dict[Endpoint, list[Endpoint]] = {}
        for link in self.links.values():
            by_src.setdefault(link.src, []).append(link.dst)
        return by_src

    def order(self, names: Sequence[str]) -> list[str]:
        """The stages in pipeline order: every link goes forward (Kahn's algorithm, ties broken by
        the order of ``names``, so the order is stable). A cycle's stages come last, in the order
        of ``names``: the spec's validation describes the cycle."""
        deps: dict[str, set[str]] = {n: set() for n in names}
        for link in self.links.values():
            if link.src.stage is not None and link.dst.stage is not None:
                deps[link.dst.stage].add(link.src.stage)
        order: list[str] = []
        done: set[str] = set()
        while len(order) < len(names):
            ready = [n for n in names if n not in done and deps[n] <= done]
            if not ready:
                order.extend(n for n in names if n not in done)
                break
            done.add(ready[0])
            order.append(ready[0])
        return order

    def direct(self) -> Iterable[Link]:
        """The links from a pipeline input straight to a pipeline output."""
        return (lk for lk in self.links.values() if lk.src.stage is None and lk.dst.stage is None)
