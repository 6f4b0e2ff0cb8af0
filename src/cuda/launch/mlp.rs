//! Gated MLPs on the GPU, many at once: a MoE layer's routed experts run as three grouped
//! launches rather than four launches per expert, with their input rows picked out on the GPU.

use anyhow::Result;
use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use rayon::prelude::*;

use super::gemm::GroupedGemm;
use super::{elements, to_u32};
use crate::cuda::device::Device;
use crate::cuda::dtype::Dtype;
use crate::cuda::memory::Buffer;
use crate::exec::mat::Mat;

impl Device {
    /// Gated MLPs `down(silu(x · gateᵀ) ⊙ x · upᵀ)` on rows of `x` (routed experts), shapes and
    /// rows checked by the caller: `x` read from its twin or sent once, each job's rows picked
    /// out here into one buffer, every output fetched in one copy, the intermediates kept here
    /// in the dtype, rounded as the separate ops round them. Each job's GEMMs are those it
    /// would get on its own, so its values are too. A single MLP on all of `x` (a dense
    /// layer's) leaves its output's twin.
    pub(in crate::cuda) fn mlps<D: Dtype>(
        &self,
        x: &Mat<f32>,
        jobs: &[GpuMlp<'_, D>],
    ) -> Result<Vec<Mat<f32>>> {
        let source = self.input::<D>(x)?;
        let whole = matches!(jobs, [GpuMlp { rows: None, .. }]);
        let picked = if whole {
            None
        } else {
            Some(self.pick_rows(x, &source, jobs)?)
        };
        let input = picked.as_ref().unwrap_or(&*source);
        let t_of = |j: &GpuMlp<'_, D>| j.rows.map_or(x.rows, <[usize]>::len);
        let out_len = |j: &GpuMlp<'_, D>| t_of(j) * j.out_rows;
        // Where this GPU runs alone each output gets its own buffer, left here as its matrix's
        // twin (the experts' weighted sum reads them here); otherwise one buffer for all,
        // fetched in one copy.
        let own_buffers = whole || self.lazy_outputs;
        let lens: Vec<usize> = jobs.iter().map(out_len).collect();
        let total: usize = lens.iter().sum();
        let outs = if own_buffers {
            lens.clone()
        } else {
            vec![total]
        };
        // A job with no intermediate features (or no inputs) writes nothing: its zeros must be
        // there already.
        let mut outs = outs
            .into_iter()
            .map(|n| {
                if jobs.iter().all(|j| j.inner > 0) {
                    self.alloc_written::<D>(n)
                } else {
                    self.alloc::<D>(n)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        // Where each job's input rows, intermediates and output start in their buffers.
        let starts_of = |len: &dyn Fn(&GpuMlp<'_, D>) -> usize| -> Vec<usize> {
            jobs.iter()
                .scan(0, |at, j| {
                    let start = *at;
                    *at += len(j);
                    Some(start)
                })
                .collect()
        };
        let cols = x.cols;
        let (at_in, at_mid) = (
            starts_of(&|j| t_of(j) * cols),
            starts_of(&|j| t_of(j) * j.inner),
        );
        let at_out = if own_buffers {
            vec![0; jobs.len()]
        } else {
            starts_of(&out_len)
        };
        let live: Vec<usize> = (0..jobs.len())
            .filter(|&i| t_of(&jobs[i]) * jobs[i].inner > 0 && jobs[i].out_rows > 0)
            .collect();
        let mid: usize = jobs.iter().map(|j| t_of(j) * j.inner).sum();
        if !live.is_empty() {
            // Every job's gate and up in one grouped GEMM, SiLU·up over all of them at once,
            // every down in another: three launches a trip, where each job's own were four.
            let (mut g, mut u) = (self.alloc_written::<D>(mid)?, self.alloc_written::<D>(mid)?);
            let stream = &self.gpu.stream;
            let at = |ptr: u64, values: usize| ptr + (values * size_of::<D>()) as u64;
            {
                let (x_ptr, _x) = input.slice.device_ptr(stream);
                let (g_ptr, _g) = g.slice.device_ptr_mut(stream);
                let (u_ptr, _u) = u.slice.device_ptr_mut(stream);
                let mut problems = Vec::with_capacity(2 * live.len());
                for (w, out) in [(0, g_ptr), (1, u_ptr)] {
                    for &i in &live {
                        let j = &jobs[i];
                        problems.push(GroupedGemm {
                            weight: &*j.weights[w].slice,
                            rows: j.inner,
                            input: at(x_ptr, at_in[i]),
                            t: t_of(j),
                            k: cols,
                            out: at(out, at_mid[i]),
                        });
                    }
                }
                self.grouped_gemm(&problems)?;
            }
            let h = self.elementwise_here("silu_mul", &g, &u, mid)?;
            let (h_ptr, _h) = h.slice.device_ptr(stream);
            let (out_ptrs, _outs): (Vec<u64>, Vec<_>) = outs
                .iter_mut()
                .map(|out| out.slice.device_ptr_mut(stream))
                .unzip();
            let mut problems = Vec::with_capacity(live.len());
            for &i in &live {
                let j = &jobs[i];
                let out = out_ptrs[if own_buffers { i } else { 0 }];
                problems.push(GroupedGemm {
                    weight: &*j.weights[2].slice,
                    rows: j.out_rows,
                    input: at(h_ptr, at_mid[i]),
                    t: t_of(j),
                    k: j.inner,
                    out: at(out, at_out[i]),
                });
            }
            self.grouped_gemm(&problems)?;
        }
        if own_buffers {
            return jobs
                .iter()
                .zip(outs)
                .map(|(j, out)| self.output(t_of(j), j.out_rows, out))
                .collect();
        }
        let all = self.download(&outs[0], total)?;
        // Each job's rows cut out of the one download, jobs in parallel (a 512-token MoE
        // layer's outputs are tens of millions of values).
        Ok(jobs
            .par_iter()
            .zip(at_out)
            .map(|(j, start)| {
                Mat::new(t_of(j), j.out_rows, all[start..start + out_len(j)].to_vec())
            })
            .collect())
    }

    /// Every job's rows of `x` (on this GPU as `source`) one after another in a new buffer:
    /// only their indices are sent (a routed expert's rows were gathered on the host and
    /// uploaded, eight times the values of `x` at GLM-5's top-8).
    fn pick_rows<D: Dtype>(
        &self,
        x: &Mat<f32>,
        source: &Buffer<D>,
        jobs: &[GpuMlp<'_, D>],
    ) -> Result<Buffer<D>> {
        let mut rows = Vec::new();
        for j in jobs {
            match j.rows {
                Some(r) => rows.extend(r.iter().map(|&r| to_u32(r)).collect::<Result<Vec<_>>>()?),
                None => rows.extend(0..to_u32(x.rows)?),
            }
        }
        let n = rows.len() * x.cols;
        let mut out = self.alloc_written::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let rows = self.upload_exact(&rows)?;
        let (cols, count) = (to_u32(x.cols)?, to_u32(n)?);
        let f = self.kernel("gather_rows", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*source.slice)
            .arg(&*rows.slice)
            .arg(&mut *out.slice)
            .arg(&cols)
            .arg(&count);
        // SAFETY: every row index is below `x.rows` (the caller's check) and `source` holds
        // x's rows × cols values; `out` holds one row of cols values per index.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }
}

/// One gated MLP of [`Device::mlps`]: its rows of the input (all of them where `None`),
/// `[gate, up, down]` on this GPU, and the gate's and down's rows.
pub(in crate::cuda) struct GpuMlp<'a, D: Dtype> {
    pub(in crate::cuda) rows: Option<&'a [usize]>,
    pub(in crate::cuda) weights: [&'a Buffer<D>; 3],
    pub(in crate::cuda) inner: usize,
    pub(in crate::cuda) out_rows: usize,
}
