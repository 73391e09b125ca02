"""The run's update screen: the registered screens (:mod:`.registry`), applied in order to a
round's replies. It returns a :class:`~.base.Screening`: what each reply became, why, and each
reply's cosine. The platform applies it (:meth:`UpdateScreen.apply`) among the run's policies
(strategies/platform/policies.py); its screens' states are the checkpoint's entries of the same
names (``strikes``, ``direction-history``, ``norm-history``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ....common.records import ARRAYS, array_views, arrays_of, to_array_record
from ..replies import clipped_update, update_norm, update_of
from . import registry
from .base import S, Screen, Screening, ScreenRound

if TYPE_CHECKING:
    from ....common.config.sections import RobustnessSection
    from ..rounds import Accepted, Sent


class UpdateScreen:
    """The run's screens, applied in order (every one off where the run is not defended)."""

    def __init__(self, screens: Sequence[Screen]) -> None:
        keys = [s.key for s in screens if s.key is not None]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two screens keep the same checkpoint entry: {sorted(keys)}")
        self.screens = tuple(screens)

    @classmethod
    def configured(cls, rob: RobustnessSection, defended: bool, dp_noise: float,
                   kinds: Sequence[type[Screen]] | None = None) -> UpdateScreen:
        """The run's screen: each registered one (``kinds``: these instead) built from robustness
        section ``rob``, every one off where the run is not ``defended``; the direction screens see
        the clients' DP noise (``dp_noise`` > 0)."""
        kinds = registry.SCREENS if kinds is None else kinds
        return cls([kind.of(rob, dp_noise > 0) if defended else kind() for kind in kinds])

    @classmethod
    def of(cls, *screens: Screen) -> UpdateScreen:
        """The registered screens with these in their place (by class), the others off."""
        given = {type(s): s for s in screens}
        unknown = [k.__name__ for k in given if k not in registry.SCREENS]
        if unknown:
            raise ValueError(f"not registered screens: {unknown}")
        return cls([given[kind] if kind in given else kind() for kind in registry.SCREENS])

    def get(self, kind: type[S]) -> S:
        """Its screen of class ``kind``."""
        for s in self.screens:
            if isinstance(s, kind):
                return s
        raise KeyError(f"no {kind.__name__} screen")

    @property
    def active(self) -> bool:
        return any(s.active for s in self.screens)

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], norms: Sequence[float],
                 tasks: Sequence[int], clients: Sequence[int] | None = None,
                 counts: Sequence[float] | None = None) -> Screening:
        """Screen one round's updates (``clients``: each update's client, for the strikes;
        ``counts``: each update's sample count, for the clip)."""
        r = ScreenRound(updates, norms, tasks, clients if clients is not None else list(range(len(updates))),
                        list(counts) if counts is not None else [0.0] * len(updates),  # 0: unknown, no allowance
                        Screening(cosines=[None] * len(updates)), screens=self.screens)
        for s in self.screens:
            s.screen(r)
        for s in self.screens:
            s.close(r)
        return r.out

    def apply(self, replies: Sequence[Accepted], start_of: Callable[[Sent], Mapping[str, np.ndarray] | None]
              ) -> tuple[list[Accepted], list[tuple[Accepted, str]], dict[str, int]]:
        """Screen a round's replies that passed the record checks, as the platform does.

        Each reply's update is measured from what ``start_of`` says its message started from (once,
        for every screen); each reply gets its ``update_norm`` and ``cosine``, and a clipped one its
        shortened arrays (its direction kept). Returns the replies kept, those excluded with why,
        and the replies each defence excluded or clipped.
        """
        # each update read from the reply's own bytes when needed (no decoded or float64 copy of every reply)
        updates = [update_of(array_views(arrays_of(a.content)), start_of(a.sent)) for a in replies]
        norms = [update_norm(u, None) for u in updates]
        screening = self(updates, norms, [a.task for a in replies], [a.sent.client for a in replies],
                         [a.examples for a in replies])
        kept, excluded = [], []
        for i, a in enumerate(replies):
            a.update_norm, a.cosine = norms[i], screening.cosines[i]
            if i in screening.excluded:
                excluded.append((a, screening.excluded[i][1]))
                continue
            if i in screening.scales:  # norm bounding: shortened, its direction kept
                a.content[ARRAYS] = to_array_record(clipped_update(
                    array_views(arrays_of(a.content)), start_of(a.sent), screening.scales[i]))
                a.update_norm = norms[i] * screening.scales[i]
            kept.append(a)
        return kept, excluded, screening.counts()

    def to_dict(self) -> dict[str, Any]:
        """Each stateful screen's checkpoint entry, by its key."""
        return {s.key: s.to_dict() for s in self.screens if s.key is not None}

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`to_dict`'s entries (a missing one: that screen starts empty)."""
        for s in self.screens:
            if s.key is not None:
                s.load(state.get(s.key, {}))
