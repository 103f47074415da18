"""Train a bucketed LSTM language model: ``python train.py [group=option ...] [key=value ...]``."""

import hydra
from omegaconf import DictConfig

from lightning_mp_lstm.app import train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
