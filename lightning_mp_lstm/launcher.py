"""Starting the rank processes of one job, and ending them so another job can start in the same process."""

from __future__ import annotations

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

__all__ = ["JobLauncher"]


class JobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher for one job (placeholder until the Hydra-multirun work lands)."""

    def release(self) -> None:
        """End this job's processes so a later job in the same process starts a fresh set."""
