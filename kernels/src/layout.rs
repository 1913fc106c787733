//! Engines' paged KV layouts, the packing of one block inside a pool slot,
//! and the CPU reference of gather (pages -> slot) and scatter (slot ->
//! pages). The GPU kernels of issue 15 must produce the same bytes; these
//! functions are what they are tested against.
//!
//! # Slot packing (layout-independent)
//!
//! A block holds `block_tokens` tokens of every layer. Inside a slot's
//! payload it is packed the same way whatever layout the engine keeps its
//! pages in, so an engine with one layout can reuse a block another wrote
//! with a different one:
//!
//! - K/V models: `[num_layers, 2 (K then V), block_tokens, kv_heads,
//!   head_dim]`, row-major, elements as the engine stores them (fp16, bf16
//!   or fp8 — gather and scatter move bytes, they never convert);
//! - MLA models: `[num_layers, block_tokens, latent_dim]`.
//!
//! # Engine layouts (one page = one block)
//!
//! | layout | per-layer tensor (row-major) |
//! |---|---|
//! | `Nhd` (vLLM flash-attn) | `[2, num_blocks, block_tokens, kv_heads, head_dim]` |
//! | `Hnd` | `[2, num_blocks, kv_heads, block_tokens, head_dim]` |
//! | `FlashInfer` | `[num_blocks, 2, block_tokens, kv_heads, head_dim]` |
//! | `Mla` | `[num_blocks, block_tokens, latent_dim]` |
//! | `CrossLayer` | one tensor for all layers: `[num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]` |
//!
//! Every size is checked (no arithmetic overflows, no access outside the
//! buffers): a bad shape or buffer is an error naming what is wrong.

/// How an engine lays out its paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Per layer `[2, num_blocks, block_tokens, kv_heads, head_dim]`.
    Nhd,
    /// Per layer `[2, num_blocks, kv_heads, block_tokens, head_dim]`.
    Hnd,
    /// Per layer `[num_blocks, 2, block_tokens, kv_heads, head_dim]`.
    FlashInfer,
    /// Per layer `[num_blocks, block_tokens, latent_dim]` (no K/V split).
    Mla,
    /// All layers in one tensor: `[num_blocks, num_layers, 2, block_tokens,
    /// kv_heads, head_dim]`.
    CrossLayer,
}

/// Element types engines store KV in (gather/scatter move their bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// fp8 (e4m3 or e5m2: one byte either way).
    Fp8,
}

impl Layout {
    /// The layout's number in the CUDA kernels and the C ABI (0 NHD, 1 HND,
    /// 2 FlashInfer, 3 MLA, 4 cross-layer).
    pub fn code(self) -> u32 {
        match self {
            Layout::Nhd => 0,
            Layout::Hnd => 1,
            Layout::FlashInfer => 2,
            Layout::Mla => 3,
            Layout::CrossLayer => 4,
        }
    }

    /// The layout of a code (see [`Layout::code`]).
    pub fn from_code(c: u32) -> Option<Layout> {
        [Layout::Nhd, Layout::Hnd, Layout::FlashInfer, Layout::Mla, Layout::CrossLayer].get(c as usize).copied()
    }
}

impl DType {
    /// The dtype of a code of the C ABI (0 fp16, 1 bf16, 2 fp8).
    pub fn from_code(c: u32) -> Option<DType> {
        [DType::F16, DType::Bf16, DType::Fp8].get(c as usize).copied()
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8 => 1,
        }
    }
}

/// The shape of an engine's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKv {
    /// Layout of the engine's tensors.
    pub layout: Layout,
    /// Element type.
    pub dtype: DType,
    /// Layers.
    pub num_layers: usize,
    /// Pages (blocks) per layer tensor.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// KV heads (K/V layouts; ignored for MLA).
    pub kv_heads: usize,
    /// Head dimension (K/V layouts), or the latent dimension (MLA).
    pub head_dim: usize,
}

/// Why a gather or scatter cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A dimension is zero, or a size overflows.
    #[error("bad shape: {0}")]
    Shape(String),
    /// The page index is outside the cache.
    #[error("page {page} is outside the {num_blocks} pages of the cache")]
    Page {
        /// Page asked.
        page: usize,
        /// Pages there are.
        num_blocks: usize,
    },
    /// A buffer has the wrong size.
    #[error("{what}: {got} bytes, expected {want}")]
    Buffer {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The size the shape needs.
        want: usize,
    },
}

fn mul(dims: &[usize], what: &str) -> Result<usize, LayoutError> {
    dims.iter().try_fold(1usize, |a, &d| {
        if d == 0 {
            return Err(LayoutError::Shape(format!("{what}: a dimension is 0 ({dims:?})")));
        }
        a.checked_mul(d).ok_or_else(|| LayoutError::Shape(format!("{what}: {dims:?} overflows")))
    })
}

impl PagedKv {
    /// The shape the bindings describe with codes ([`Layout::code`],
    /// [`DType::from_code`]) and `[num_layers, num_blocks, block_tokens,
    /// kv_heads, head_dim]` (`kv_heads` is ignored for MLA). Unknown codes
    /// and dimensions beyond `usize` are errors; zeros are caught by the
    /// size checks of every operation.
    pub fn from_codes(layout: u32, dtype: u32, dims: [u64; 5]) -> Result<PagedKv, LayoutError> {
        let layout = Layout::from_code(layout)
            .ok_or_else(|| LayoutError::Shape(format!("layout code {layout} is not one of 0 to 4")))?;
        let dtype = DType::from_code(dtype)
            .ok_or_else(|| LayoutError::Shape(format!("dtype code {dtype} is not one of 0 to 2")))?;
        let d = |i: usize| {
            usize::try_from(dims[i]).map_err(|_| LayoutError::Shape(format!("dimension {} is too large", dims[i])))
        };
        Ok(PagedKv {
            layout,
            dtype,
            num_layers: d(0)?,
            num_blocks: d(1)?,
            block_tokens: d(2)?,
            kv_heads: if layout == Layout::Mla { 1 } else { d(3)? },
            head_dim: d(4)?,
        })
    }

    fn kv(&self) -> usize {
        if self.layout == Layout::Mla { 1 } else { 2 }
    }

    fn heads(&self) -> usize {
        if self.layout == Layout::Mla { 1 } else { self.kv_heads }
    }

    /// Bytes of one row (one token's head, or its latent vector).
    fn row_bytes(&self) -> Result<usize, LayoutError> {
        mul(&[self.head_dim, self.dtype.bytes()], "row")
    }

    /// Bytes of one row: the unit gather and scatter move contiguously.
    pub fn row_bytes_pub(&self) -> Result<usize, LayoutError> {
        self.row_bytes()
    }

    /// The packed block's dimensions in slot order: (layers, K/V, tokens,
    /// heads); MLA has one "K/V" and one "head".
    pub fn dims(&self) -> (usize, usize, usize, usize) {
        (self.num_layers, self.kv(), self.block_tokens, self.heads())
    }

    /// Bytes of one block packed in a slot.
    pub fn block_bytes(&self) -> Result<usize, LayoutError> {
        mul(&[self.num_layers, self.kv(), self.block_tokens, self.heads(), self.row_bytes()?], "block")
    }

    /// How many engine tensors there are (one per layer, or one for all),
    /// and the bytes of each.
    pub fn tensors(&self) -> Result<(usize, usize), LayoutError> {
        let per_block = mul(&[self.kv(), self.block_tokens, self.heads(), self.row_bytes()?], "page")?;
        match self.layout {
            Layout::CrossLayer => Ok((1, mul(&[self.num_blocks, self.num_layers, per_block], "cache")?)),
            _ => Ok((self.num_layers, mul(&[self.num_blocks, per_block], "layer")?)),
        }
    }

    /// Byte offset in the engine tensor of layer `l`'s row (`kv`, token `t`,
    /// head `h`) of page `b` (and which tensor).
    fn engine_row(&self, b: usize, l: usize, kv: usize, t: usize, h: usize) -> (usize, usize) {
        let (nb, nl, tt, hh) = (self.num_blocks, self.num_layers, self.block_tokens, self.heads());
        let row = match self.layout {
            Layout::Nhd => ((kv * nb + b) * tt + t) * hh + h,
            Layout::Hnd => ((kv * nb + b) * hh + h) * tt + t,
            Layout::FlashInfer => ((b * 2 + kv) * tt + t) * hh + h,
            Layout::Mla => b * tt + t,
            Layout::CrossLayer => ((((b * nl + l) * 2 + kv) * tt + t) * hh) + h,
        };
        let tensor = if self.layout == Layout::CrossLayer { 0 } else { l };
        (tensor, row)
    }

    fn check(&self, page: usize, tensors: &[usize], slot: usize) -> Result<usize, LayoutError> {
        let block = self.block_bytes()?;
        let (n, bytes) = self.tensors()?;
        if page >= self.num_blocks {
            return Err(LayoutError::Page { page, num_blocks: self.num_blocks });
        }
        if tensors.len() != n {
            return Err(LayoutError::Buffer { what: "engine tensors (count)", got: tensors.len(), want: n });
        }
        if let Some(&got) = tensors.iter().find(|&&t| t != bytes) {
            return Err(LayoutError::Buffer { what: "engine tensor", got, want: bytes });
        }
        if slot < block {
            return Err(LayoutError::Buffer { what: "slot payload", got: slot, want: block });
        }
        self.row_bytes()
    }

    /// Visits every row of page `page` in slot order: (slot offset, tensor,
    /// tensor offset), all in bytes. The shape was checked.
    fn rows(&self, page: usize, row: usize, mut f: impl FnMut(usize, usize, usize)) {
        let mut at = 0;
        for l in 0..self.num_layers {
            for kv in 0..self.kv() {
                for t in 0..self.block_tokens {
                    for h in 0..self.heads() {
                        let (tensor, r) = self.engine_row(page, l, kv, t, h);
                        f(at, tensor, r * row);
                        at += row;
                    }
                }
            }
        }
    }

    /// Gathers page `page` of the engine's tensors (one per layer, or one
    /// for all with `CrossLayer`) into `slot` (at least
    /// [`PagedKv::block_bytes`] long), in the slot packing. Returns the
    /// bytes written.
    pub fn gather(&self, tensors: &[&[u8]], page: usize, slot: &mut [u8]) -> Result<usize, LayoutError> {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
        let row = self.check(page, &sizes, slot.len())?;
        self.rows(page, row, |at, tensor, off| {
            slot[at..at + row].copy_from_slice(&tensors[tensor][off..off + row]);
        });
        self.block_bytes()
    }

    /// Scatters a block packed in `slot` into page `page` of the engine's
    /// tensors; nothing else of them is written.
    pub fn scatter(&self, slot: &[u8], page: usize, tensors: &mut [&mut [u8]]) -> Result<usize, LayoutError> {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
        let row = self.check(page, &sizes, slot.len())?;
        self.rows(page, row, |at, tensor, off| {
            tensors[tensor][off..off + row].copy_from_slice(&slot[at..at + row]);
        });
        self.block_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layout: Layout, dtype: DType) -> PagedKv {
        PagedKv { layout, dtype, num_layers: 3, num_blocks: 5, block_tokens: 4, kv_heads: 2, head_dim: 8 }
    }

    /// A pseudo-random byte of logical element (block, layer, kv, token,
    /// head, byte within the row): the same value whatever the layout.
    fn value(b: usize, l: usize, kv: usize, t: usize, h: usize, i: usize) -> u8 {
        let x = ((((b * 31 + l) * 7 + kv) * 131 + t) * 17 + h) * 257 + i;
        (x.wrapping_mul(0x9e37_79b9) >> 13) as u8
    }

    /// The engine tensors of `s` filled with `value` at every logical place.
    fn fill(s: &PagedKv) -> Vec<Vec<u8>> {
        let (n, bytes) = s.tensors().unwrap();
        let mut out = vec![vec![0u8; bytes]; n];
        let row = s.row_bytes().unwrap();
        for b in 0..s.num_blocks {
            for l in 0..s.num_layers {
                for kv in 0..s.kv() {
                    for t in 0..s.block_tokens {
                        for h in 0..s.heads() {
                            let (tensor, r) = s.engine_row(b, l, kv, t, h);
                            for i in 0..row {
                                let v = value(b, l, kv, t, h, i);
                                assert_eq!(out[tensor][r * row + i], 0, "two logical places share a byte");
                                out[tensor][r * row + i] = v;
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_layout_packs_a_block_the_same_way_and_scatter_inverts_gather() {
        for dtype in [DType::F16, DType::Bf16, DType::Fp8] {
            let kv_layouts = [Layout::Nhd, Layout::Hnd, Layout::FlashInfer, Layout::CrossLayer];
            let mut packed: Vec<Vec<u8>> = Vec::new();
            for layout in kv_layouts.into_iter().chain([Layout::Mla]) {
                let s = shape(layout, dtype);
                let engine = fill(&s);
                let views: Vec<&[u8]> = engine.iter().map(|t| &t[..]).collect();
                let mut slot = vec![0u8; s.block_bytes().unwrap() + 16];
                assert_eq!(s.gather(&views, 3, &mut slot).unwrap(), s.block_bytes().unwrap());
                assert!(slot[s.block_bytes().unwrap()..].iter().all(|&b| b == 0), "nothing past the block");
                if layout != Layout::Mla {
                    packed.push(slot.clone());
                }
                // The slot packing: [L, kv, T, H, row], whatever the layout.
                let row = s.row_bytes().unwrap();
                let mut at = 0;
                for l in 0..s.num_layers {
                    for kv in 0..s.kv() {
                        for t in 0..s.block_tokens {
                            for h in 0..s.heads() {
                                for i in 0..row {
                                    assert_eq!(slot[at], value(3, l, kv, t, h, i), "{layout:?} at {at}");
                                    at += 1;
                                }
                            }
                        }
                    }
                }
                // Scatter into page 1 of zeroed tensors: exactly page 1's
                // bytes, as gathered, and nothing else.
                let (n, bytes) = s.tensors().unwrap();
                let mut out = vec![vec![0u8; bytes]; n];
                let mut views: Vec<&mut [u8]> = out.iter_mut().map(|t| &mut t[..]).collect();
                s.scatter(&slot, 1, &mut views).unwrap();
                let mut back = vec![0u8; s.block_bytes().unwrap()];
                let views: Vec<&[u8]> = out.iter().map(|t| &t[..]).collect();
                s.gather(&views, 1, &mut back).unwrap();
                assert_eq!(back[..], slot[..back.len()], "{layout:?}: scatter then gather");
                for b in (0..s.num_blocks).filter(|&b| b != 1) {
                    s.gather(&views, b, &mut back).unwrap();
                    assert!(back.iter().all(|&x| x == 0), "{layout:?}: page {b} was written");
                }
            }
            assert!(packed.windows(2).all(|w| w[0] == w[1]), "K/V layouts pack one block identically");
        }
    }

    #[test]
    fn bad_shapes_and_buffers_are_errors() {
        let s = shape(Layout::Nhd, DType::F16);
        let engine = fill(&s);
        let views: Vec<&[u8]> = engine.iter().map(|t| &t[..]).collect();
        let mut slot = vec![0u8; s.block_bytes().unwrap()];
        assert!(matches!(s.gather(&views, 5, &mut slot), Err(LayoutError::Page { page: 5, num_blocks: 5 })));
        assert!(matches!(s.gather(&views[..2], 0, &mut slot), Err(LayoutError::Buffer { .. })));
        let mut short = vec![0u8; slot.len() - 1];
        assert!(matches!(s.gather(&views, 0, &mut short), Err(LayoutError::Buffer { what: "slot payload", .. })));
        let zero = PagedKv { kv_heads: 0, ..s };
        assert!(matches!(zero.block_bytes(), Err(LayoutError::Shape(_))));
        let huge = PagedKv { num_blocks: usize::MAX / 2, ..s };
        assert!(matches!(huge.tensors(), Err(LayoutError::Shape(_))));
    }
}
