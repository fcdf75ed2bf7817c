"""Pipeline-parallel engine: stage split, interleaved 1F1B, p2p transport, AttnRes block cache,
comm accounting and timeline profiling. Imports only torch and megatron-core."""
from pipeline.accounting import CommRecord, CommRecorder, ComputeSpan
from pipeline.engine import PipelineEngine
from pipeline.layout import PipelineLayout, chunks_of_rank, split_layers
from pipeline.p2p import MsgKey, PipeComm
from pipeline.schedule import (Op, all_schedules, build_schedule, check_microbatches, num_warmup,
                               schedule_table, simulate)
from pipeline.stage_io import StageIO
from pipeline.transport import (TransportPlan, build_plan, cached_volume_exact, cached_volume_k3,
                                closed_form_volume, naive_volume, predicted_bytes)

__all__ = [
    "CommRecord", "CommRecorder", "ComputeSpan", "MsgKey", "Op", "PipeComm", "PipelineEngine",
    "PipelineLayout", "StageIO", "TransportPlan", "all_schedules", "build_plan", "build_schedule",
    "cached_volume_exact", "cached_volume_k3", "check_microbatches", "chunks_of_rank",
    "closed_form_volume", "naive_volume", "num_warmup", "predicted_bytes", "schedule_table",
    "simulate", "split_layers",
]
