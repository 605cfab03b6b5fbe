"""The inspector's sharding-map panel: :class:`tui.sharding_map.ShardingMap` of the selected
tensor."""

from __future__ import annotations

from textual.widgets import Static

from shardscope.core import CheckpointLayout, TensorInfo
from shardscope.tui.sharding_map import ShardingMap


class ShardingMapView(Static):
    """The sharding map of the selected tensor (empty until one is selected)."""

    tensor: TensorInfo | None = None
    layout: CheckpointLayout | None = None

    drawn_for: int = -1

    def _room(self) -> int:
        """Lines the grid may take: the scrolling panel's height less the title and legend."""
        box = self.parent.scrollable_content_region.height if self.parent else 0
        return max(3, box - 4)

    def on_resize(self) -> None:
        if self.tensor is not None and self._room() != self.drawn_for:
            self.show(self.tensor, self.layout)  # the panel was shown or resized

    def show(self, tensor: TensorInfo | None, layout: CheckpointLayout) -> None:
        """Draw ``tensor``'s map (None: a hint to select one)."""
        self.tensor, self.layout = tensor, layout
        self.drawn_for = self._room()
        self.update(ShardingMap(tensor, layout, height=self.drawn_for)
                    if tensor is not None else "[dim]select a tensor to see how it is cut[/]")
