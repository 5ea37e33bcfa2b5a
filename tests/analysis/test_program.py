"""The cost model read from a program's text alone (trainer/analysis/program.py), and
the FLOPs it counts (trainer/analysis/hlo.py), on hand-made HLO with figures worked out
by hand. No compilation."""

import pathlib

import pytest

from trainer.analysis import flops, hlo, program
from trainer.parallel import hardware

V5E = hardware.ACCELERATORS["v5e"]


def _types(*lines: str) -> dict[str, str]:
    return {ins.name: ins.type_text for ins in map(hlo.instruction, lines) if ins}


def test_a_projection_to_heads_counts_only_the_real_window_positions():
    # libtpu 0.0.52 writes x [batch 4, length 256, embed 512] @ w [embed 512, heads 4,
    # head_dim 64] as a window of 4 over a padded axis of 1 (v5e:2x2 program): one real
    # position per head. By hand: 2 x 1024 tokens x 512 x 256 outputs.
    x = "%x = bf16[4,256,512,1]{2,1,3,0} parameter(0)"
    w = "%w = bf16[4,64,512,1]{2,1,0,3} parameter(1)"
    q = (
        "%q = bf16[4,256,4,64]{3,1,2,0} convolution(%x, %w), window={size=1x4 pad=0_0x3_3 "
        "rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f"
    )
    assert flops.matmul_flops(q, _types(x, w)) == 2 * 1024 * 512 * 256
    # The weight gradient: dW [512, 2048] = x^T dy over a window of the batch (4) x 256.
    a = "%a = bf16[4,256,512]{2,1,0} parameter(0)"
    dy = "%dy = bf16[4,256,2048]{2,1,0} parameter(1)"
    grad = (
        "%g = bf16[512,2048,1]{1,0,2} convolution(%a, %dy), window={size=4}, "
        "dim_labels=0fb_0io->bf0"
    )
    assert flops.matmul_flops(grad, _types(a, dy)) == 2 * 1024 * 512 * 2048
    dot = "%d = f32[8,16]{1,0} dot(%l, %r), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    types = _types("%l = f32[8,32]{1,0} parameter(0)", "%r = f32[32,16]{1,0} parameter(1)")
    assert flops.matmul_flops(dot, types) == 2 * 8 * 16 * 32
    assert flops.matmul_flops("%s = f32[8]{0} add(%l, %l)", types) == 0


def test_attention_kernels_count_their_matmuls_from_their_shapes():
    # MaxText's splash backward (its 16B on v5e-256: 6 rows, 64 heads, 2048, 128).
    dkv = (
        "  %splash_mha_dkv_segmented_no_residuals.1 = (bf16[6,64,2048,128]{3,2,1,0}, "
        "bf16[6,64,2048,128]{3,2,1,0}) custom-call(%q, %k, %v), "
        'custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{}}'
    )
    square = 2 * 6 * 64 * 2048 * 2048 * 128
    assert flops.attention_kernel(dkv) == (4 * square, False)  # scores, dV, dP, dK
    # Ours, forward: it states its own cost, which XLA counts.
    fwd = (
        "  %flash_attention.9 = (bf16[4,4,256,64]{3,2,1,0}, f32[4,4,256,128]{3,2,1,0}) "
        'custom-call(%q, %k, %v), custom_call_target="tpu_custom_call", backend_config='
        '{"cost_estimate":{"flops":"272891904","bytes_accessed":"6848512"}}'
    )
    assert flops.attention_kernel(fwd) == (2 * 2 * 4 * 4 * 256 * 256 * 64, True)
    assert flops.attention_kernel('  %c = f32[4] custom-call(%x), custom_call_target="Foo"') is None


# A 4-layer scan, hand-made (its header says what each trip does).
_SCAN = (pathlib.Path(__file__).parent / "libtpu" / "scan_roofline.txt").read_text()


def test_the_roofline_reads_a_layer_of_a_stack_not_the_stack():
    found = program.roofline(_SCAN, V5E)
    layer = 512 * 512 * 2  # one layer's weight, bf16
    activations = 256 * 512 * 2
    # Each trip: the matmul reads h and one layer of the stack (`%s#2`, sliced in a
    # nested fusion), writes its result; the update reads that result and writes it
    # into its row of the stacked output in place (the stack itself untouched); the
    # counter's add reads two s32 and writes one. The condition's compare (two s32 in,
    # a pred out) is counted once, as the loop's trips are counted for its body only.
    matmul = activations + layer + 4 + activations
    update = 2 * activations + activations + 4
    per_trip = matmul + update + 3 * 4
    assert found.bytes == 4 * per_trip + 9
    assert found.flops == 4 * 2 * 256 * 512 * 512
    assert found.kernels == 4 * 3 + 1
    per_kernel = (
        max(2 * 256 * 512 * 512 / V5E.peak_flops(), matmul / V5E.hbm_bandwidth())
        + update / V5E.hbm_bandwidth()
        + 12 / V5E.hbm_bandwidth()
    )
    assert found.seconds == pytest.approx(4 * per_kernel + 9 / V5E.hbm_bandwidth())
    assert flops.dot_flops(_SCAN) == found.flops


def test_tuple_elements_and_their_bytes():
    text = "(s32[]{:T(128)}, bf16[6,2048]{1,0:T(8,128)(2,1)S(1)}, /*index=2*/(f32[2], u8[3]))"
    assert hlo.tuple_elements(text) == [
        "s32[]{:T(128)}",
        "bf16[6,2048]{1,0:T(8,128)(2,1)S(1)}",
        "(f32[2], u8[3])",
    ]
    types = {"state": text}
    assert hlo.operand_bytes("state#1", types) == 6 * 2048 * 2
    assert hlo.operand_bytes("state#2", types) == 11
    assert hlo.operand_bytes("state", types) == 4 + 6 * 2048 * 2 + 11


def test_memory_usage_report_is_read():
    report = """Memory Space: default (color=0)
Total bytes: 9741432320 (9.07GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    3.00GiB( 21%);    3.00GiB;      2162688;                5; 5×bf16[32,6,2048,4096]
    3.73GiB( 26%);  750.00MiB;   3917086720;                1; bf16[6,2048,32000]
"""
    total, buffers = program.memory_report(report)
    assert total == 9741432320
    assert [(b.bytes, b.values, b.shapes) for b in buffers] == [
        (3 * 2**30, 5, "5×bf16[32,6,2048,4096]"),
        (750 * 2**20, 1, "bf16[6,2048,32000]"),
    ]
