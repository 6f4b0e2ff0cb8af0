"""The family in plain torch, shaped as SGLang 0.5.23 builds it, so that the real dumper's hooks
see what they see in SGLang: the same `named_modules()` (models/deepseek_v2.py, "dv2" below),
each module called with the same positional and keyword arguments, returning the same kinds of
values, on a single-node TP prefill (no DP attention, EP, PP or CP). GLM-5
(`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2 run DSA's MHA one-shot prefill; DeepSeek-V2, V2-Lite,
V3 and Kimi-K2 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) and GLM-4.7-Flash
(`Glm4MoeLiteForCausalLM`, models/glm4_moe_lite.py) the dense MLA prefill, which on an empty
prefix is the same MHA path (attention_backend_handler.py:125-138, MHA_ONE_SHOT on fa3 and
flashinfer, :25; forward_mha.py:181 forward_normal_prepare, :296 forward_normal_core); kv_b_proj
runs either way. Each member differs by its config (weights.config), never by a copy.
The references "file:line" are into sglang/srt/ of the 0.5.23 wheel. Faults (`FAULTS`) are
bugs planted here, as SGLang-like code could have them.
"""

import torch
import torch.nn.functional as F
from torch import nn

from glmcheck_oracle.sglang.layers import (Linear, LayerNorm, RadixAttention, RMSNorm,
                                           RotaryEmbedding, all_gather_last, all_reduce,
                                           mla_softmax_scale, tp)
from glmcheck_oracle.sglang.moe import MLP, MoE
from glmcheck_oracle.sglang.standins import (Contribution, LogitsProcessorOutput,
                                             OwedOutput)

FAULTS = ("skip-o-proj-all-reduce", "unsharded-kv-b", "rank-order-q-b", "rope-neox",
          "router-softmax", "routed-scale-twice", "group-limit-ignored", "yarn-mscale-dropped")


class Indexer(nn.Module):
    """layers/attention/dsa/dsa_indexer.py:267. On a prefill no longer than index_topk the
    indexer only writes its K cache (`_forward_cuda_k_only`, :1711; chosen at :1974 by
    `_should_skip_logits_computation`, :846) and returns None. With `indexer_rope_interleave`
    (GPT-J rope) SGLang fuses wk and weights_proj into `wk_weights_proj` (:352) and does
    k_norm and rope in one kernel (:1016); otherwise wk → k_norm → rotary_emb (:979)."""

    def __init__(self, w, cfg, dtype):
        super().__init__()
        self.head_dim, self.rope_dim = cfg["index_head_dim"], cfg["qk_rope_head_dim"]
        self.fused = bool(cfg.get("indexer_rope_interleave", False))
        self.wq_b = Linear(w["wq_b"])
        if self.fused:
            self.wk_weights_proj = Linear(torch.cat([w["wk"], w["weights_proj"]]))
        else:
            self.wk = Linear(w["wk"])
            self.weights_proj = Linear(w["weights_proj"])
        self.k_norm = LayerNorm(w["k_norm.weight"], w["k_norm.bias"])
        self.rotary_emb = RotaryEmbedding(self.rope_dim, cfg, not self.fused, dtype)

    def forward(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True):
        if self.fused:
            key = self.wk_weights_proj(x)[0][:, : self.head_dim]
            key = self.k_norm.forward(key)  # inside the fused kernel: no hook
            rope = self.rotary_emb.rotate(positions, key[:, : self.rope_dim])
        else:
            key = self.k_norm(self.wk(x)[0])
            k_rope = key[:, : self.rope_dim]
            _, rope = self.rotary_emb(positions, torch.empty_like(k_rope), k_rope)
        key = torch.cat([rope, key[:, self.rope_dim:]], dim=-1)
        cache = forward_batch.kv_cache.setdefault(("index_k", layer_id), [])
        cache.append(key)  # what the K cache would hold (before its Hadamard rotation)
        return None


class Attention(nn.Module):
    """DeepseekV2AttentionMLA (dv2:2010), on the MHA prefill (forward_mha.py:181
    forward_normal_prepare, :296 forward_normal_core): the query from the q LoRA
    (fused_qkv_a_proj_with_mqa, q_a_layernorm, q_b_proj) or, with q_lora_rank null, from q_proj
    beside kv_a_proj_with_mqa (dv2:2069-2101, forward_mha.py:188-222)."""

    def __init__(self, w, cfg, layer_id, dtype, fault):
        super().__init__()
        self.layer_id = layer_id
        self.nope, self.rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.q_lora, self.kv_lora = (cfg["v_head_dim"], cfg["q_lora_rank"],
                                                 cfg["kv_lora_rank"])
        self.local_heads = cfg["num_attention_heads"] // tp()[1]
        if self.q_lora is not None:
            self.fused_qkv_a_proj_with_mqa = Linear(w["fused_qkv_a"])
            self.q_a_layernorm = RMSNorm(w["q_a_layernorm"], cfg["rms_norm_eps"])
            self.q_b_proj = Linear(w["q_b_proj"])
        else:
            self.q_proj = Linear(w["q_proj"])
            self.kv_a_proj_with_mqa = Linear(w["kv_a_proj_with_mqa"])
        self.kv_b_proj = Linear(w["kv_b_proj"])
        self.o_proj = Linear(w["o_proj"])
        self.kv_a_layernorm = RMSNorm(w["kv_a_layernorm"], cfg["rms_norm_eps"])
        # dv2:2166: is_neox_style = not rope_interleave (default True).
        neox = not cfg.get("rope_interleave", True)
        self.rotary_emb = RotaryEmbedding(self.rope, cfg, neox != (fault == "rope-neox"), dtype)
        # A "shared" DSA layer (skip_topk) has no indexer and reuses the carried top-k
        # (dv2:2117); on this path it computes nothing either way.
        self.indexer = Indexer(w["indexer"], cfg, dtype) if w["indexer"] else None
        scaling = (self.nope + self.rope) ** -0.5
        if cfg["rope_scaling"] and fault != "yarn-mscale-dropped":
            scaling = mla_softmax_scale(cfg["rope_scaling"], scaling)
        self.attn_mqa = RadixAttention(scaling)
        self.attn_mha = RadixAttention(scaling)

    def forward(self, positions, hidden_states, forward_batch, zero_allocator,
                input_on_attn_tp_slices=False, llama_4_scaling=None, prev_topk_indices=None):
        if self.q_lora is not None:
            # dv2:2525 prepare_qkv_latent, fetched lazily inside the attention
            # (forward_mha.py:191)
            latent = self.fused_qkv_a_proj_with_mqa(hidden_states)[0]
            q, latent_cache = latent.split([self.q_lora, self.kv_lora + self.rope], dim=-1)
            q_lora = self.q_a_layernorm(q)
            q = self.q_b_proj(q_lora)[0].view(-1, self.local_heads, self.nope + self.rope)
            if self.indexer is not None:  # forward_mha.py:205, :107
                self.indexer(x=hidden_states, q_lora=q_lora, positions=positions,
                             forward_batch=forward_batch, layer_id=self.layer_id,
                             return_indices=False)
        else:
            q = self.q_proj(hidden_states)[0].view(-1, self.local_heads, self.nope + self.rope)
            latent_cache = self.kv_a_proj_with_mqa(hidden_states)[0]
        q_pe = q[..., self.nope:]
        kv_a, _ = latent_cache.split([self.kv_lora, self.rope], dim=-1)
        latent_cache = latent_cache.unsqueeze(1)
        kv_a = self.kv_a_layernorm(kv_a)
        k_pe = latent_cache[:, :, self.kv_lora:]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        # The MLA KV cache (latent + roped k_pe); a later forward reads it back whole, as
        # DSA's MHA one-shot does with a prefix (forward_mha.py:246-270).
        cache = forward_batch.kv_cache.setdefault(("mla", self.layer_id), [])
        cache.append((kv_a, k_pe))
        kv_a = torch.cat([c[0] for c in cache])
        k_pe = torch.cat([c[1] for c in cache])
        kv = self.kv_b_proj(kv_a)[0].view(-1, self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
        k = torch.cat([k_nope, k_pe.expand(-1, self.local_heads, -1)], dim=-1)
        out = self.attn_mha(q, k, v, forward_batch, save_kv_cache=False,
                            key_value_num_tokens=k.shape[0])
        return self.o_proj(out)[0]  # partial sum at TP > 1 (reduce_results=False, dv2:2639)


class DecoderLayer(nn.Module):
    """DeepseekV2DecoderLayer.forward (dv2:2794) with the layer_boundary residual stream of
    a TP prefill: the input norm adds the previous layer's completed output to the residual
    (layer_boundary/residual/add_norm.py:190, `norm(h, residual, None)`; the first layer
    `norm(h)`, :189), the attention's partial sum is all-reduced before the FFN norm
    (factories.py:741 always_partial; prepare.py:359), `norm(h, residual)` (add_norm.py:419),
    and the FFN's all-reduce is deferred to the next layer's input: at TP > 1 the layer
    returns `(OwedOutput, None)` (exit.py:315-330, stream.py:175), at TP 1 `(mlp output,
    None)`, the residual staying in the stream (forward_batch.residual_stream).
    GLM-4.7-Flash's Glm4MoeLiteDecoderLayer.forward (glm4_moe_lite.py:529) goes through the
    same boundaries and returns the OwedOutput or output alone (:561), which the dumper then
    records as the layer's `output`."""

    def __init__(self, w, cfg, layer_id, dtype, fault):
        super().__init__()
        self.layer_id, self.fault, self.lite = layer_id, fault, cfg["lite"]
        self.self_attn = Attention(w["self_attn"], cfg, layer_id, dtype, fault)
        self.mlp = MoE(w["mlp"], cfg, fault) if "gate" in w["mlp"] else MLP(w["mlp"])
        self.input_layernorm = RMSNorm(w["input_layernorm"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(w["post_attention_layernorm"],
                                                cfg["rms_norm_eps"])

    def forward(self, positions, hidden_states, forward_batch, zero_allocator,
                gemm_output_zero_allocator=None, llama_4_scaling=None, prev_topk_indices=None,
                captured_last_layer_outputs=None, next_full_attention_layer_id=None,
                capture_output=None):
        stream = forward_batch.residual_stream
        if stream.residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(
                complete(hidden_states), stream.residual, None)
        hidden_states = self.self_attn(
            positions=positions, hidden_states=hidden_states, forward_batch=forward_batch,
            zero_allocator=zero_allocator, llama_4_scaling=llama_4_scaling,
            input_on_attn_tp_slices=False, prev_topk_indices=prev_topk_indices)
        if not (self.fault == "skip-o-proj-all-reduce" and self.layer_id == 1):
            hidden_states = all_reduce(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states, forward_batch, None)
        stream.residual = residual
        if tp()[1] > 1:
            hidden_states = OwedOutput(Contribution(hidden_states))
        return hidden_states if self.lite else (hidden_states, None)


def complete(hidden_states):
    """Finish what a layer output owes: the deferred all-reduce of an OwedOutput."""
    if isinstance(hidden_states, OwedOutput):
        return all_reduce(hidden_states.contribution.value)
    return hidden_states


class ResidualStream:
    """layer_boundary/residual/stream.py:86, reduced to the residual it carries."""

    residual = None


class VocabParallelEmbedding(nn.Module):
    """layers/vocab_parallel_embedding.py: this rank's block of the (64-padded) vocabulary;
    ids outside it give zeros, and the all-reduce makes the output whole on every rank."""

    def __init__(self, weight, start):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start

    def forward(self, input_ids):
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(out * inside[:, None].to(out.dtype))


class LogitsProcessor(nn.Module):
    """layers/logits_processor.py: the last token of the request, `hidden · lm_head.weight^T`
    in the model dtype (:1200, lm_head is read, never called), gathered over TP in rank
    order, cut to the vocabulary and made f32 (:1347, :1368)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        last = hidden_states[-1:]
        logits = all_gather_last(torch.matmul(last, lm_head.weight.T))
        return LogitsProcessorOutput(next_token_logits=logits[:, : self.vocab_size].float())


class DeepseekV2Model(nn.Module):
    """dv2:2925/3094: embed, the layers (each `layer(positions, h, forward_batch,
    zero_allocator, gemm_output_zero_allocator, llama_4_scaling, prev_topk_indices=,
    captured_last_layer_outputs=, next_full_attention_layer_id=)`, dv2:3185), the final
    norm on the completed output and the residual (residual/batch.py:135, access.py:51)."""

    def __init__(self, w, cfg, dtype, fault):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(w["embed"], w["vocab_start"])
        self.layers = nn.ModuleList(DecoderLayer(lw, cfg, i, dtype, fault)
                                    for i, lw in enumerate(w["layers"]))
        self.norm = RMSNorm(w["norm"], cfg["rms_norm_eps"])

    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                pp_proxy_tensors=None):
        hidden_states = self.embed_tokens(input_ids)
        forward_batch.residual_stream = stream = ResidualStream()
        # zero_allocator: SGLang passes a BumpAllocator, which the dumper skips as a tensor-less
        # value, as it skips None.
        topk_indices = None
        for i, layer in enumerate(self.layers):
            if layer.lite:  # Glm4MoeLiteModel.forward, glm4_moe_lite.py:651
                hidden_states = layer(positions, hidden_states, forward_batch, None,
                                      capture_output=None)
            else:
                hidden_states, topk_indices = layer(
                    positions, hidden_states, forward_batch, None, None, None,
                    prev_topk_indices=topk_indices, captured_last_layer_outputs=None,
                    next_full_attention_layer_id=i + 1 if i + 1 < len(self.layers) else None)
        hidden_states, _ = self.norm(complete(hidden_states), stream.residual)
        return hidden_states


class DeepseekV2ForCausalLM(nn.Module):
    """DeepseekV2ForCausalLM (dv2:3248, forward :3405), which GlmMoeDsaForCausalLM
    (glm4_moe.py:1284), DeepseekV3ForCausalLM (dv2:3518) and DeepseekV32ForCausalLM (:3522)
    are, and Glm4MoeLiteForCausalLM (glm4_moe_lite.py:685, forward :755) mirrors: the root,
    whose `forward(input_ids, positions, forward_batch)` the model runner calls
    (runner/eager_runner.py:361) and the dumper wraps (dumper.py:777)."""

    def __init__(self, w, cfg, dtype, fault=None):
        super().__init__()
        self.model = DeepseekV2Model(w, cfg, dtype, fault)
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(w["lm_head"], requires_grad=False)
        self.logits_processor = LogitsProcessor(cfg["vocab_size"])

    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                pp_proxy_tensors=None):
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds,
                                   pp_proxy_tensors)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, None)

    def all_logits(self, hidden_states):
        """Every position's logits (f32), for checking against transformers."""
        logits = all_gather_last(torch.matmul(hidden_states, self.lm_head.weight.T))
        return logits[:, : self.logits_processor.vocab_size].float()
