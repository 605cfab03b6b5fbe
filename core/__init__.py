"""shardscope's headless core: formats, layout, merge planning and execution.

Never imports textual or rich; torch only inside functions that move tensor data.
"""
