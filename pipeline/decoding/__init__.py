"""The one speculative decoding loop (B=1 is autoregressive), sampling and block-size schedules."""

from pipeline.decoding.schedules import BlockSizeSchedule, EMASchedule, FixedSchedule
from pipeline.decoding.speculative import DecodeConfig, RequestStats, SpeculativeDecoder

__all__ = ["BlockSizeSchedule", "DecodeConfig", "EMASchedule", "FixedSchedule", "RequestStats", "SpeculativeDecoder"]
