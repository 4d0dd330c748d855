"""The one speculative decoding loop (B=1 is autoregressive), sampling and block-size schedules."""

from pipeline.decoding.schedules import EMASchedule, ExternalDecode, FixedSchedule, Schedule
from pipeline.decoding.speculative import DecodeConfig, RequestStats, SpeculativeDecoder

__all__ = ["DecodeConfig", "EMASchedule", "ExternalDecode", "FixedSchedule", "RequestStats", "Schedule", "SpeculativeDecoder"]
