"""shardscope's headless core: formats, layout, merge planning and execution.

Never imports textual or rich; torch only inside functions that move tensor data.
The three steps every front end uses::

    layout = detect(path)                      # metadata only
    plan = plan_merge(layout, MergeOptions(output="merged"))
    result = run_merge(plan, on_progress=print, cancel=threading.Event())
"""

from .errors import (BadCheckpointError, MergeCancelled, OutputExistsError, ReadCancelled,
                     ShardscopeError, UnsafeCheckpointError, UsageError)
from .execute import MergeProgress, MergeResult, run_merge
from .formats import detect
from .layout import CheckpointLayout, Piece, Problem, SourceFile, TensorInfo
from .plan import MergeOptions, MergePlan, plan_merge

__all__ = [
    "BadCheckpointError", "CheckpointLayout", "MergeCancelled", "MergeOptions", "MergePlan",
    "MergeProgress", "MergeResult", "OutputExistsError", "Piece", "Problem", "ReadCancelled", "ShardscopeError",
    "SourceFile", "TensorInfo", "UnsafeCheckpointError", "UsageError", "detect", "plan_merge",
    "run_merge",
]
