"""An inductor graph pass for the tied embedding's gradient: the head's part and the lookup's rows summed in one buffer.

The tied weight gets two gradients: the head's, dense (V x E), and the token lookup's, a scatter of the batch's rows.
Inductor lowers the lookup's as a scatter-add into a fresh zero-filled (V x E) tensor (torch 2.13 decomposes
embedding_dense_backward to _unsafe_masked_index_put_accumulate, torch 2.11 to index_put(accumulate=True): either is
rewritten), then adds the head's to it:
at GPT-2's 50,304 x 256 in fp32 that zero-fills and rereads 51 MB it did not need, one kernel of 11.7 ms in a
small-cpu step on an AMX Xeon. The pass rewrites add(dense, scatter_add(zeros, rows)) into scatter_add(dense, rows):
the same sum, the rows added after the dense part rather than before (fp32, each entry's few adds in another order);
the kernel then takes 7 ms, the step ~2% less there (BENCHMARKS.md, "The tied gradient in one buffer").
training.compile_cache.set_up_compile_cache installs it before a process's first compile (its import brings
inductor and torch._dynamo, 1.1 s, which processes that do not compile are spared).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


def _is_scatter_add(node: torch.fx.Node) -> bool:
    """Whether node adds rows into its first argument at indices: embedding_dense_backward as torch decomposes it."""
    if node.target is aten._unsafe_masked_index_put_accumulate.default:  # (into, mask, indices, values), torch 2.13
        return True
    if node.target is aten.index_put.default:  # (into, indices, values, accumulate), torch 2.11
        return bool(node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False))
    return False


def _scatter_into_zeros(node: torch.fx.Node) -> bool:
    """Whether node scatter-adds rows into a zero-filled tensor that nothing else uses, and nothing else uses it."""
    if node.op != "call_function" or not _is_scatter_add(node) or len(node.users) != 1:
        return False
    zeros = node.args[0]
    return (
        zeros.op == "call_function"
        and zeros.target is aten.full.default
        and zeros.args[1] == 0
        and len(zeros.users) == 1
    )


class TiedGradientSum(CustomGraphPass):
    """A post-grad pass (torch._inductor.config.post_grad_custom_post_pass); rewritten counts its rewrites."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
            if len(add.args) != 2 or add.kwargs or not all(isinstance(a, torch.fx.Node) for a in add.args):
                continue
            for dense, scatter in (add.args, add.args[::-1]):
                want, got = add.meta.get("val"), dense.meta.get("val")
                if not _scatter_into_zeros(scatter) or want is None or got is None:
                    continue
                rows = scatter.meta["val"]
                if not (got.shape == want.shape == rows.shape and got.dtype == want.dtype == rows.dtype):
                    continue  # the add neither broadcasts nor casts: it is the scatter's own sum
                zeros = scatter.args[0]
                with graph.inserting_before(add):  # the same scatter-add, into the dense gradient
                    summed = graph.call_function(scatter.target, (dense, *scatter.args[1:]), dict(scatter.kwargs))
                summed.meta.update(add.meta)
                add.replace_all_uses_with(summed)
                for node in (add, scatter, zeros):
                    graph.erase_node(node)
                self.rewritten += 1
                break

    def uuid(self) -> bytes:
        """Its source's hash: inductor's FX graph cache keys compiled graphs on it."""
        return get_hash_for_files((__file__,))


def install() -> None:
    """Install the pass for this process's compiles, unless another post-grad pass is installed (the user's wins)."""
    import torch._inductor.config as inductor_config

    if inductor_config.post_grad_custom_post_pass is None:
        inductor_config.post_grad_custom_post_pass = TiedGradientSum()
