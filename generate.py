"""Sample text from a trained model: ``python generate.py ckpt_path=<file or sharded directory> [prompt="..."] ...``.

The checkpoint may come from any layout (one file, a sharded directory, or Lightning's own strategies); the model
runs on one process with the vocabulary saved in the checkpoint. Settings: ``conf/generate.yaml``. The samples go
to standard output, one per line; warnings and errors to standard error (an error exits with status 1).
"""

import sys
import warnings

import hydra
from omegaconf import DictConfig

from lightning_mp_lstm.app.generation import generate_from_checkpoint


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            samples = generate_from_checkpoint(
                cfg.ckpt_path, prompt="" if cfg.prompt is None else str(cfg.prompt), num_samples=cfg.num_samples,
                max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed,
                device=cfg.device,
            )
    except (ValueError, FileNotFoundError) as error:  # CheckpointError is a ValueError
        sys.exit(f"generate.py: {error}")  # the message alone, exit status 1
    for warning in caught:
        print(f"generate.py: warning: {warning.message}", file=sys.stderr)
    for sample in samples:
        print(sample, flush=True)


if __name__ == "__main__":
    main()
