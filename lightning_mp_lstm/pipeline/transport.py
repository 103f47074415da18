"""What a process group's transport lets the engine do with receives posted ahead of their sends.

gloo sends a message at once only to a receive already posted; to a later one it answers once asked, a round trip
through the sender's transport thread, which on busy cores waits for the sender's computation (0.45 ms against
0.04 ms measured between two CPU processes). It matches a message by its sender and tag, so a receive may be posted
long before its send, out of the schedule's order. NCCL pairs point-to-point operations in the order they are
issued: there a receive posted ahead would take another message, and every exchange keeps its place.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["posts_receives_ahead"]


def posts_receives_ahead(group: dist.ProcessGroup) -> bool:
    """Whether receives over ``group`` may be posted ahead of their sends: its transport matches messages by sender
    and tag (gloo)."""
    return dist.get_backend(group) == "gloo"
