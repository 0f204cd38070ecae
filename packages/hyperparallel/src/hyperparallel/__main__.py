"""`python -m hyperparallel` (also under `torchrun ... -m hyperparallel`): `spore train`."""

from hyperparallel.cli import train

if __name__ == "__main__":
    train(prog_name="python -m hyperparallel")
