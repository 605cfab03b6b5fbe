"""shardscope's front ends: the Textual app and the command line (Rich)."""
