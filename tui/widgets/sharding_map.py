"""The inspector's sharding-map panel: :class:`tui.sharding_map.ShardingMap` of the selected
tensor."""

from __future__ import annotations

from textual.widgets import Static

from core import CheckpointLayout, TensorInfo
from tui.sharding_map import ShardingMap


class ShardingMapView(Static):
    """The sharding map of the selected tensor (empty until one is selected)."""

    def show(self, tensor: TensorInfo | None, layout: CheckpointLayout) -> None:
        self.tensor = tensor
        self.update(ShardingMap(tensor, layout, height=max(3, self.size.height - 4))
                    if tensor is not None else "[dim]select a tensor to see how it is cut[/]")
