"""Gemma-4-style multi-token-prediction drafter: config, network, head, inference, checkpoints."""

from specdraft.drafters.mtp.checkpoint import (
    drafter_config_for,
    init_network,
    load_mtp_drafter,
    load_network,
    save_network,
)
from specdraft.drafters.mtp.config import MTPConfig
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.drafters.mtp.network import MTPNetwork

__all__ = ["MTPConfig", "MTPDrafter", "MTPNetwork", "drafter_config_for", "init_network", "load_mtp_drafter",
           "load_network", "save_network"]
