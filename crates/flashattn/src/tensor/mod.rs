//! Strided tensors on a device. A tensor is a shared buffer plus shape, strides and offset, so
//! transposes and other views cost no copy: a `[batch, heads, seqlen, head_dim]` buffer is passed to
//! attention as its `[batch, seqlen, heads, head_dim]` view with `transpose(1, 2)`.

mod copy;
mod storage;

use std::any::Any;
use std::sync::Arc;

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::host_buf::{Foreign, HostBuf};

pub(crate) use storage::{CpuStorage, DeviceStorage, HostElement, Storage};

/// Where a tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; always available.
    Cpu,
    /// An NVIDIA GPU, by ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A strided view of a shared buffer. Cloning is cheap (the buffer is reference counted).
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Arc<Storage>,
    dtype: DType,
    device: Device,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// The most elements a tensor may have: any copy of it (8 bytes an element at most, f64 in the
/// oracle) must fit in an allocation, which is limited to `isize::MAX` bytes.
pub(crate) const MAX_ELEMENTS: usize = isize::MAX as usize / 8;

/// The element count of `shape`, if it is at most [`MAX_ELEMENTS`].
fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
}

impl Tensor {
    /// A contiguous (row-major) tensor that owns `data` (moved, not copied), which must hold
    /// exactly the shape's element count. A `Vec` starts wherever the allocator put it, while the
    /// CPU kernels read a little faster from buffers that start on a cache line and huge pages,
    /// as [`Tensor::from_slice`] (a copy), [`Tensor::full`] and flashattn's outputs do (see
    /// [`crate::set_huge_pages`]; [`Tensor::from_vec_strided`] takes an offset into your own).
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(t.shape(), &[2, 3]);
    /// assert_eq!(t.transpose(0, 1)?.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        expect_len(data.len(), shape)?;
        Self::from_vec_strided(data, shape, &contiguous_strides(shape), 0)
    }

    /// A tensor over `data` with explicit strides (in elements) and offset. Every element the view
    /// can reach must lie inside `data`; `data` may hold more (a view of a larger buffer).
    pub fn from_vec_strided<T: Element>(
        data: Vec<T>,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        let storage = CpuStorage::of(HostBuf::Taken(data));
        Self::from_cpu_storage(storage, shape, strides, offset, "data")
    }

    /// A contiguous (row-major) tensor holding a copy of `data` (exactly the shape's element
    /// count), in a buffer flashattn allocates the way it does its outputs: starting on a cache
    /// line and, from 2 MiB on, on a huge page (see [`crate::set_huge_pages`]), which the CPU
    /// kernels read fastest. Large slices are copied by all threads.
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(t.transpose(0, 1)?.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        expect_len(data.len(), shape)?;
        let storage = CpuStorage::of(HostBuf::copied(data));
        Self::from_cpu_storage(storage, shape, &contiguous_strides(shape), 0, "data")
    }

    /// A tensor over host memory that another owner holds (a PyTorch or NumPy array's), used
    /// where it lies: `len` elements of `dtype` at `ptr`, viewed with `shape`, `strides` (in
    /// elements) and `offset` as [`Tensor::from_vec_strided`] checks them. `keep` is held until
    /// the last tensor over the memory is dropped (pass the owner, or `Box::new(())` when the
    /// memory outlives the tensor anyway). Clones and views share the memory read-only (only a
    /// tensor no other shares receives outputs); a copy (a dtype conversion, say) is flashattn's.
    ///
    /// # Safety
    /// Unless `len` is 0, `ptr` points to `len` initialized elements of `dtype` that stay valid
    /// and that nothing outside flashattn writes while the tensor (or a clone or view of it)
    /// lives. When the tensor receives an output ([`forward_into`](crate::forward_into),
    /// [`backward_into`](crate::backward_into)), nothing else may read the memory during the call
    /// either: no input of the same call may overlap it.
    ///
    /// ```
    /// use flashattn::{DType, Tensor};
    /// let mut mem = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    /// // SAFETY: `mem` outlives `t` and is not touched while `t` lives.
    /// let t = unsafe {
    ///     Tensor::from_host_raw(mem.as_mut_ptr().cast(), DType::F32, 6, &[3, 2], &[1, 3], 0, Box::new(()))
    /// }?;
    /// assert_eq!(t.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub unsafe fn from_host_raw(
        ptr: *mut u8,
        dtype: DType,
        len: usize,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        if len > MAX_ELEMENTS {
            return Err(Error::arg("len", "at most 2^60 elements", len));
        }
        let align = dtype.size_in_bytes();
        if len > 0 && (ptr.is_null() || !ptr.addr().is_multiple_of(align)) {
            return Err(Error::arg(
                "ptr",
                format!("a non-null pointer aligned to {align} bytes ({dtype})"),
                format!("{ptr:p}"),
            ));
        }
        // SAFETY: the caller's contract is `Foreign::new`'s; the pointer was checked non-null and
        // aligned for the element type the dtype names.
        let storage = unsafe {
            match dtype {
                DType::F32 => {
                    CpuStorage::F32(HostBuf::Foreign(Foreign::new(ptr.cast::<f32>(), len, keep)))
                }
                DType::F16 => {
                    CpuStorage::F16(HostBuf::Foreign(Foreign::new(ptr.cast::<f16>(), len, keep)))
                }
                DType::BF16 => CpuStorage::BF16(HostBuf::Foreign(Foreign::new(
                    ptr.cast::<bf16>(),
                    len,
                    keep,
                ))),
            }
        };
        Self::from_cpu_storage(storage, shape, strides, offset, "len")
    }

    pub(crate) fn from_cpu_storage(
        storage: CpuStorage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        arg: &'static str,
    ) -> Result<Self> {
        check_view(storage.len(), shape, strides, offset, arg)?;
        Ok(Tensor {
            dtype: storage.dtype(),
            storage: Arc::new(Storage::Cpu(storage)),
            device: Device::Cpu,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        })
    }

    /// A view of a device buffer (every element it can reach must lie inside the buffer).
    pub(crate) fn from_device_storage(
        storage: Box<dyn DeviceStorage>,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        check_view(storage.len(), shape, strides, offset, "storage")?;
        Ok(Tensor {
            dtype: storage.dtype(),
            device: storage.device(),
            storage: Arc::new(Storage::Device(storage)),
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        })
    }

    /// The same view (shape, strides, dtype) over another buffer, on `device`, at `offset`.
    pub(crate) fn with_storage(&self, storage: Storage, device: Device, offset: usize) -> Self {
        Tensor {
            storage: Arc::new(storage),
            device,
            offset,
            ..self.clone()
        }
    }

    /// The whole device buffer behind the view, when the tensor is not on the host.
    pub(crate) fn device_storage(&self) -> Option<&dyn DeviceStorage> {
        match &*self.storage {
            Storage::Device(s) => Some(&**s),
            Storage::Cpu(_) => None,
        }
    }
}

/// Checks that a contiguous tensor of `shape` takes exactly `len` elements (`data`'s).
fn expect_len(len: usize, shape: &[usize]) -> Result<()> {
    let numel = checked_numel(shape).ok_or_else(|| too_large(shape))?;
    if len != numel {
        return Err(Error::arg(
            "data",
            format!("{numel} elements (shape {shape:?})"),
            format!("{len} elements"),
        ));
    }
    Ok(())
}

/// The error for a shape of more than [`MAX_ELEMENTS`] elements.
fn too_large(shape: &[usize]) -> Error {
    Error::arg(
        "shape",
        "a shape of at most 2^60 elements",
        format!("{shape:?}"),
    )
}

/// Checks that every element of a view lies inside a buffer of `len` elements.
fn check_view(
    len: usize,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
    arg: &'static str,
) -> Result<()> {
    if strides.len() != shape.len() {
        return Err(Error::arg(
            "strides",
            format!("{} strides (one per dimension)", shape.len()),
            strides.len(),
        ));
    }
    let numel = checked_numel(shape).ok_or_else(|| too_large(shape))?;
    if numel > 0 {
        let last = shape.iter().zip(strides).try_fold(offset, |acc, (&d, &s)| {
            (d - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
        });
        match last {
            Some(last) if last < len => {}
            _ => {
                return Err(Error::arg(
                    arg,
                    format!(
                        "a buffer holding shape {shape:?} with strides {strides:?} and offset {offset}"
                    ),
                    format!("{len} elements"),
                ));
            }
        }
    }
    Ok(())
}

impl Tensor {
    /// A contiguous tensor of `shape` with every element `value` (rounded to `dtype`), starting on
    /// a 64-byte cache line (at an offset into its buffer).
    pub fn full(shape: &[usize], dtype: DType, value: f32) -> Result<Self> {
        let numel = checked_numel(shape).ok_or_else(|| too_large(shape))?;
        let storage = CpuStorage::filled(dtype, numel, value);
        Self::from_cpu_storage(storage, shape, &contiguous_strides(shape), 0, "shape")
    }

    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stride of each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The element offset of the view's first element in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the view is row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.numel() == 0
            || self
                .shape
                .iter()
                .zip(&self.strides)
                .zip(contiguous_strides(&self.shape))
                .all(|((&d, &s), c)| d == 1 || s == c)
    }

    /// The same data with dimensions `a` and `b` swapped (no copy).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        let rank = self.rank();
        for (name, d) in [("dim a", a), ("dim b", b)] {
            if d >= rank {
                return Err(Error::arg(
                    if name == "dim a" { "a" } else { "b" },
                    format!("a dimension index below the rank {rank}"),
                    d,
                ));
            }
        }
        let mut t = self.clone();
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        Ok(t)
    }

    /// Another view of the same buffer (no copy, on any device): `shape` with `strides` (in
    /// elements) starting at element `offset` of the buffer. Every element it reaches must lie
    /// inside the buffer.
    ///
    /// ```
    /// use flashattn::Tensor;
    /// let t = Tensor::from_vec((0..12).map(|i| i as f32).collect::<Vec<_>>(), &[12])?;
    /// let v = t.view(&[2, 3], &[6, 2], 1)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    pub fn view(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        check_view(self.buffer_len(), shape, strides, offset, "self")?;
        Ok(Tensor {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            ..self.clone()
        })
    }

    /// Elements in the whole buffer behind the view.
    fn buffer_len(&self) -> usize {
        self.storage.len()
    }

    /// The whole host buffer behind the view (index it with `offset` and `strides`).
    pub(crate) fn cpu_storage(&self) -> Option<&CpuStorage> {
        match &*self.storage {
            Storage::Cpu(s) => Some(s),
            Storage::Device(_) => None,
        }
    }

    /// True when no other tensor (clone or view) shares this one's buffer.
    pub(crate) fn is_exclusive(&mut self) -> bool {
        Arc::get_mut(&mut self.storage).is_some()
    }

    /// The host buffer of a tensor whose buffer is not shared with any other tensor.
    pub(crate) fn cpu_storage_mut(&mut self) -> Option<&mut CpuStorage> {
        match Arc::get_mut(&mut self.storage)? {
            Storage::Cpu(s) => Some(s),
            Storage::Device(_) => None,
        }
    }

    /// The whole host buffer as `T`, when the tensor is on the host and of that type.
    pub(crate) fn cpu_slice<T: HostElement>(&self) -> Option<&[T]> {
        self.cpu_storage().and_then(T::slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttentionParams, forward, forward_into};

    /// A tensor over `mem` (which must outlive it and be left alone meanwhile).
    fn over(mem: &mut [f32], shape: &[usize], strides: &[usize]) -> Result<Tensor> {
        // SAFETY: every caller keeps `mem` alive and untouched while the tensor lives.
        unsafe {
            Tensor::from_host_raw(
                mem.as_mut_ptr().cast(),
                DType::F32,
                mem.len(),
                shape,
                strides,
                0,
                Box::new(()),
            )
        }
    }

    /// Views that reach past the memory, null or misaligned pointers are argument errors.
    #[test]
    fn foreign_memory_is_checked_like_a_vector() {
        let mut mem = vec![0.0f32; 8];
        let arg = |r: Result<Tensor>| r.unwrap_err().argument();
        assert_eq!(arg(over(&mut mem, &[3, 3], &[3, 1])), Some("len"));
        assert_eq!(arg(over(&mut mem, &[2, 4], &[4])), Some("strides"));
        assert!(over(&mut mem, &[2, 4], &[1, 2]).is_ok());
        // SAFETY: the calls fail before the pointers could be used.
        let (null, odd) = unsafe {
            let p = mem.as_mut_ptr().cast::<u8>();
            let keep = || Box::new(()) as Box<dyn Any + Send + Sync>;
            (
                Tensor::from_host_raw(std::ptr::null_mut(), DType::F32, 4, &[4], &[1], 0, keep()),
                Tensor::from_host_raw(p.add(2), DType::F32, 4, &[4], &[1], 0, keep()),
            )
        };
        assert_eq!((arg(null), arg(odd)), (Some("ptr"), Some("ptr")));
        // SAFETY: no elements, so the null pointer is never used.
        let empty = unsafe {
            Tensor::from_host_raw(
                std::ptr::null_mut(),
                DType::F16,
                0,
                &[0, 3],
                &[3, 1],
                0,
                Box::new(()),
            )
        };
        assert_eq!(empty.unwrap().numel(), 0);
    }

    /// `forward_into` writes into foreign memory where it lies (the same values `forward`
    /// returns); a clone shares it read-only, so it cannot receive an output, and a dtype
    /// conversion is a copy; the owner lives as long as the last tensor over the memory.
    #[test]
    fn outputs_are_written_into_foreign_memory() {
        let (b, n, h, d) = (2, 7, 3, 8);
        let mut x: Vec<f32> = (0..b * n * h * d)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let mut out_mem = vec![f32::NAN; b * n * h * d];
        let mut lse_mem = vec![f32::NAN; b * h * n];
        let q = over(&mut x, &[b, n, h, d], &contiguous_strides(&[b, n, h, d])).unwrap();
        let p = AttentionParams::default().causal();
        let owner = Arc::new(());
        // SAFETY: `out_mem` outlives `out` and is read only after `out` is dropped.
        let mut out = unsafe {
            Tensor::from_host_raw(
                out_mem.as_mut_ptr().cast(),
                DType::F32,
                out_mem.len(),
                &[b, n, h, d],
                &contiguous_strides(&[b, n, h, d]),
                0,
                Box::new(owner.clone()),
            )
        }
        .unwrap();
        let mut lse = over(&mut lse_mem, &[b, h, n], &contiguous_strides(&[b, h, n])).unwrap();
        let shared = out.clone();
        let err = forward_into(&q, &q, &q, &p, &mut out, &mut lse).unwrap_err();
        assert_eq!(err.argument(), Some("out"));
        let copy = shared.to_dtype(DType::BF16).unwrap();
        drop(shared);
        forward_into(&q, &q, &q, &p, &mut out, &mut lse).unwrap();
        let want = forward(&q, &q, &q, &p).unwrap();
        assert_eq!(Arc::strong_count(&owner), 2);
        drop((out, lse, q));
        assert_eq!(Arc::strong_count(&owner), 1);
        assert_eq!(out_mem, want.out.to_vec::<f32>().unwrap());
        assert_eq!(lse_mem, want.lse.to_vec::<f32>().unwrap());
        assert!(copy.to_f64_vec().unwrap().iter().all(|v| v.is_nan()));
    }
}
