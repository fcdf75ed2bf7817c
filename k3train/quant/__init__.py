"""Low precision (docs/quantization.md): exact OCP MX v1.0 emulation and MX QAT."""

from k3train.quant.mx import dequantize_mx, fake_quant_mx, pack_fp4, quantize_mx, unpack_fp4
from k3train.quant.qat import MXFakeQuant, mx_fake_quant, mx_qat_linear, quantized_grouped_weight

__all__ = [
    "MXFakeQuant",
    "dequantize_mx",
    "fake_quant_mx",
    "mx_fake_quant",
    "mx_qat_linear",
    "pack_fp4",
    "quantize_mx",
    "quantized_grouped_weight",
    "unpack_fp4",
]
