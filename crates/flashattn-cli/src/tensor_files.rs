//! Named tensors in files: `.safetensors` (every dtype) and `.npz` (numpy's savez and
//! savez_compressed archives of `.npy` arrays: f32, f16, int32; numpy has no bfloat16). A `.npy`
//! file holds a single unnamed array, so it cannot carry q, k and v: it is refused with a message.
//! The `.npy` arrays are read and written by `npyz`; the archive by `zip` (npyz's own `npz`
//! feature would bring in a second, older zip).

use std::io::{Read, Write};
use std::path::Path;

use flashattn::{DType, Tensor};
use half::{bf16, f16};
use npyz::TypeChar;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorInfo, TensorView};

use super::output::PendingFile;
use super::{CliResult, fail};

/// The elements of one tensor, as stored.
#[derive(Clone, Debug)]
pub enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    /// A dtype flashattn does not read, by name (`F64`, `numpy <i8`, ...).
    Other(String),
}

impl Data {
    /// The dtype's name in messages: `f32`, `f16`, `bf16`, `int32`, or the file's own name.
    pub fn dtype_name(&self) -> String {
        match self {
            Data::F32(_) => "f32".into(),
            Data::F16(_) => "f16".into(),
            Data::BF16(_) => "bf16".into(),
            Data::I32(_) => "int32".into(),
            Data::Other(name) => name.clone(),
        }
    }

    /// The flashattn dtype, for the three float types.
    pub fn float_dtype(&self) -> Option<DType> {
        match self {
            Data::F32(_) => Some(DType::F32),
            Data::F16(_) => Some(DType::F16),
            Data::BF16(_) => Some(DType::BF16),
            Data::I32(_) | Data::Other(_) => None,
        }
    }

    /// How many elements are NaN and how many infinite (floats only; 0 and 0 otherwise).
    pub fn non_finite(&self) -> (usize, usize) {
        fn count<T: Copy>(v: &[T], nan: fn(T) -> bool, inf: fn(T) -> bool) -> (usize, usize) {
            v.iter().fold((0, 0), |(n, i), &x| {
                (n + usize::from(nan(x)), i + usize::from(inf(x)))
            })
        }
        match self {
            Data::F32(v) => count(v, f32::is_nan, f32::is_infinite),
            Data::F16(v) => count(v, f16::is_nan, f16::is_infinite),
            Data::BF16(v) => count(v, bf16::is_nan, bf16::is_infinite),
            Data::I32(_) | Data::Other(_) => (0, 0),
        }
    }

    /// Bytes of the elements.
    pub fn byte_len(&self) -> usize {
        match self {
            Data::F32(v) => v.len() * 4,
            Data::I32(v) => v.len() * 4,
            Data::F16(v) => v.len() * 2,
            Data::BF16(v) => v.len() * 2,
            Data::Other(_) => 0,
        }
    }

    /// Appends the elements as little-endian bytes.
    pub fn extend_le_bytes(&self, out: &mut Vec<u8>) {
        match self {
            Data::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Data::I32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Data::F16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Data::BF16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Data::Other(_) => {}
        }
    }

    /// A host tensor's elements in row-major order of its shape.
    pub fn from_tensor(t: &Tensor) -> CliResult<Self> {
        Ok(match t.dtype() {
            DType::F32 => Data::F32(t.to_vec()?),
            DType::F16 => Data::F16(t.to_vec()?),
            DType::BF16 => Data::BF16(t.to_vec()?),
        })
    }

    /// A contiguous tensor of these elements (floats only).
    pub fn to_tensor(&self, shape: &[usize]) -> Option<CliResult<Tensor>> {
        let t = match self {
            Data::F32(v) => Tensor::from_vec(v.clone(), shape),
            Data::F16(v) => Tensor::from_vec(v.clone(), shape),
            Data::BF16(v) => Tensor::from_vec(v.clone(), shape),
            Data::I32(_) | Data::Other(_) => return None,
        };
        Some(t.map_err(Into::into))
    }
}

/// A named tensor of a file.
#[derive(Clone, Debug)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Data,
}

/// The file formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Safetensors,
    Npz,
}

/// The format of `path` from its extension; `option` (`--input`, `--output`) names it in errors.
pub fn format_of(path: &Path, option: &str) -> CliResult<Format> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("safetensors") => Ok(Format::Safetensors),
        Some("npz") => Ok(Format::Npz),
        Some("npy") => Err(fail(format!(
            "{option} {}: a .npy file holds a single array, but run reads q, k, v (and more) and \
             writes out, lse (and more): use .npz (numpy's savez) or .safetensors",
            path.display()
        ))),
        _ => Err(fail(format!(
            "{option} {}: unknown file type (expected .safetensors or .npz)",
            path.display()
        ))),
    }
}

fn from_le<const N: usize, T>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
        .collect()
}

/// Why the header of a safetensors file refused by the safetensors crate is wrong, naming the
/// tensor at fault: the crate's own message names none for a shape that disagrees with its data
/// offsets, or for data that ends short of or past the file. `None` where the header does not
/// parse or no tensor is at fault.
fn bad_tensor(bytes: &[u8]) -> Option<String> {
    let len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = std::str::from_utf8(bytes.get(8..8usize.checked_add(len)?)?).ok()?;
    let data_len = bytes.len() - 8 - len;
    let entries: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_str(header).ok()?;
    let mut infos = entries
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| Some((name, serde_json::from_value::<TensorInfo>(v).ok()?)))
        .collect::<Option<Vec<_>>>()?;
    // The data of the tensors follow one another in the order of their offsets.
    infos.sort_by_key(|(_, info)| info.data_offsets);
    let mut end = 0;
    for (name, info) in &infos {
        let (start, stop) = info.data_offsets;
        let (shape, dtype) = (&info.shape, info.dtype);
        let bits = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize()));
        let fault = match bits {
            None => Some(format!("shape {shape:?} of {dtype} is too large")),
            Some(b) if b % 8 != 0 => Some(format!("shape {shape:?} of {dtype} is not whole bytes")),
            Some(_) if start != end || stop < start => Some(format!(
                "data_offsets [{start}, {stop}] do not start where the previous tensor's data \
                 ends ({end})"
            )),
            Some(b) if stop - start != b / 8 => Some(format!(
                "shape {shape:?} of {dtype} needs {} bytes, but data_offsets [{start}, {stop}] \
                 hold {}",
                b / 8,
                stop - start
            )),
            Some(_) if stop > data_len => Some(format!(
                "data_offsets [{start}, {stop}] run past the end of the data ({data_len} bytes)"
            )),
            Some(_) => None,
        };
        if let Some(fault) = fault {
            return Some(format!("tensor `{name}`: {fault}"));
        }
        end = stop;
    }
    let (name, _) = infos.last()?;
    (end < data_len).then(|| {
        format!(
            "tensor `{name}`, the last in the file, ends at byte {end} of the data, but the \
             data holds {data_len} bytes"
        )
    })
}

fn read_safetensors(path: &Path, bytes: &[u8]) -> CliResult<Vec<NamedTensor>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        let why = bad_tensor(bytes).unwrap_or_else(|| e.to_string());
        fail(format!(
            "--input {}: not a valid safetensors file: {why}",
            path.display()
        ))
    })?;
    let mut out: Vec<NamedTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let b = view.data();
            let data = match view.dtype() {
                StDtype::F32 => Data::F32(from_le(b, f32::from_le_bytes)),
                StDtype::F16 => Data::F16(from_le(b, f16::from_le_bytes)),
                StDtype::BF16 => Data::BF16(from_le(b, bf16::from_le_bytes)),
                StDtype::I32 => Data::I32(from_le(b, i32::from_le_bytes)),
                other => Data::Other(other.to_string()),
            };
            NamedTensor {
                name,
                shape: view.shape().to_vec(),
                data,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// One `.npy` array: its shape and elements. f4, f2 and i4 of either byte order are read; any
/// other dtype is kept by its numpy name, for the caller to refuse by tensor.
fn read_npy(r: impl Read) -> Result<(Vec<usize>, Data), String> {
    let npy = npyz::NpyFile::new(r).map_err(|e| format!("not a .npy array: {e}"))?;
    if npy.order() == npyz::Order::Fortran {
        return Err(
            "Fortran-ordered array (save it C-contiguous, e.g. with np.ascontiguousarray)".into(),
        );
    }
    let shape = npy
        .shape()
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("dimension {d} is too large")))
        .collect::<Result<Vec<_>, _>>()?;
    let (plain, name) = match npy.dtype() {
        npyz::DType::Plain(t) => (Some((t.type_char(), t.size_field())), t.to_string()),
        other => (None, other.descr()),
    };
    let data = match plain {
        Some((TypeChar::Float, 4)) => npy.into_vec().map(Data::F32),
        Some((TypeChar::Float, 2)) => npy.into_vec().map(Data::F16),
        Some((TypeChar::Int, 4)) => npy.into_vec().map(Data::I32),
        _ => return Ok((shape, Data::Other(format!("numpy {name}")))),
    };
    Ok((
        shape,
        data.map_err(|e| format!("cannot read the data: {e}"))?,
    ))
}

/// Writes one `.npy` array of `shape` (C order, the machine's byte order).
fn write_npy(w: impl Write, shape: &[usize], data: &Data) -> Result<(), String> {
    fn put<T: npyz::AutoSerialize + Copy>(
        w: impl Write,
        shape: &[u64],
        v: &[T],
    ) -> std::io::Result<()> {
        use npyz::WriterBuilder as _;
        let mut writer = npyz::WriteOptions::new()
            .default_dtype()
            .shape(shape)
            .writer(w)
            .begin_nd()?;
        writer.extend(v.iter().copied())?;
        writer.finish()
    }
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    match data {
        Data::F32(v) => put(w, &shape, v),
        Data::F16(v) => put(w, &shape, v),
        Data::I32(v) => put(w, &shape, v),
        Data::BF16(_) | Data::Other(_) => {
            return Err(format!(
                "{} cannot be stored in .npz (numpy has no such dtype): write .safetensors \
                 instead",
                data.dtype_name()
            ));
        }
    }
    .map_err(|e| e.to_string())
}

fn read_npz(path: &Path) -> CliResult<Vec<NamedTensor>> {
    let bad = |e: String| fail(format!("--input {}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| bad(format!("not a valid .npz (zip) archive: {e}")))?;
    let mut out = Vec::new();
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| bad(e.to_string()))?;
        let entry_name = entry
            .name()
            .map_err(|e| bad(format!("entry {i}: {e}")))?
            .to_string();
        let name = npyz::npz::array_name_from_file_name(&entry_name)
            .ok_or_else(|| bad(format!("entry `{entry_name}` is not a .npy array")))?
            .to_string();
        let (shape, data) =
            read_npy(&mut entry).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        out.push(NamedTensor { name, shape, data });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Reads every tensor of `path` (sorted by name).
pub fn read(path: &Path) -> CliResult<Vec<NamedTensor>> {
    let format = format_of(path, "--input")?;
    match format {
        Format::Safetensors => {
            let bytes = std::fs::read(path)
                .map_err(|e| fail(format!("--input {}: {e}", path.display())))?;
            read_safetensors(path, &bytes)
        }
        Format::Npz => read_npz(path),
    }
}

/// Checks that `format` can hold `dtype`, before any work is done.
pub fn check_storable(path: &Path, format: Format, dtype: DType) -> CliResult<()> {
    if format == Format::Npz && dtype == DType::BF16 {
        return Err(fail(format!(
            "--output {}: bf16 results cannot be stored in .npz (numpy has no bfloat16): \
             write .safetensors instead",
            path.display()
        )));
    }
    Ok(())
}

fn safetensors_bytes(tensors: &[NamedTensor]) -> CliResult<Vec<u8>> {
    let raw = tensors
        .iter()
        .map(|t| {
            let dtype = match t.data {
                Data::F32(_) => StDtype::F32,
                Data::F16(_) => StDtype::F16,
                Data::BF16(_) => StDtype::BF16,
                Data::I32(_) => StDtype::I32,
                Data::Other(ref name) => {
                    return Err(fail(format!(
                        "tensor `{}`: cannot write dtype {name}",
                        t.name
                    )));
                }
            };
            let mut bytes = Vec::with_capacity(t.data.byte_len());
            t.data.extend_le_bytes(&mut bytes);
            Ok((t.name.clone(), dtype, t.shape.clone(), bytes))
        })
        .collect::<CliResult<Vec<_>>>()?;
    let views = raw
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| fail(format!("tensor `{name}`: {e}")))
        })
        .collect::<CliResult<Vec<_>>>()?;
    safetensors::tensor::serialize(views, None).map_err(|e| fail(format!("safetensors: {e}")))
}

fn write_npz(file: &mut std::fs::File, tensors: &[NamedTensor]) -> CliResult<()> {
    let mut zip = zip::ZipWriter::new(file);
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(true);
    for t in tensors {
        zip.start_file(npyz::npz::file_name_from_array_name(&t.name), options)
            .map_err(|e| fail(format!("npz: {e}")))?;
        write_npy(&mut zip, &t.shape, &t.data)
            .map_err(|e| fail(format!("tensor `{}`: {e}", t.name)))?;
    }
    zip.finish().map_err(|e| fail(format!("npz: {e}")))?;
    Ok(())
}

/// Writes `tensors` in the format of `file`'s destination and renames it into place.
pub fn write(file: PendingFile, tensors: &[NamedTensor]) -> CliResult<()> {
    let path = file.path().to_path_buf();
    match format_of(&path, "--output")? {
        Format::Safetensors => {
            let bytes = safetensors_bytes(tensors)?;
            file.finish(|f| {
                f.write_all(&bytes)
                    .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))
            })
        }
        Format::Npz => file.finish(|f| write_npz(f, tensors)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npyz::WriterBuilder as _;

    fn npy_bytes(data: &Data, shape: &[usize]) -> Vec<u8> {
        let mut b = Vec::new();
        write_npy(&mut b, shape, data).unwrap();
        b
    }

    #[test]
    fn npy_round_trip_keeps_shape_dtype_and_values() {
        let cases = [
            (Data::F32(vec![1.0, -2.5, 3.25, 0.0, 7.0, 8.5]), vec![2, 3]),
            (
                Data::F16([0.5f32, -1.0, 65504.0].map(f16::from_f32).to_vec()),
                vec![3],
            ),
            (Data::I32(vec![0, 5, -9, 1 << 30]), vec![2, 1, 2]),
            (Data::F32(vec![4.0]), vec![]),
        ];
        for (data, shape) in cases {
            let (back_shape, back) = read_npy(&npy_bytes(&data, &shape)[..]).unwrap();
            assert_eq!(back_shape, shape);
            assert_eq!(format!("{back:?}"), format!("{data:?}"));
        }
        let bf = Data::BF16(vec![bf16::ONE]);
        assert!(
            write_npy(Vec::new(), &[1], &bf)
                .unwrap_err()
                .contains("bf16")
        );
    }

    #[test]
    fn other_npy_arrays_are_named_or_refused_not_misread() {
        let f64s = |order: npyz::Order| {
            let mut b = Vec::new();
            let mut w = npyz::WriteOptions::<f64>::new()
                .default_dtype()
                .order(order)
                .shape(&[2])
                .writer(&mut b)
                .begin_nd()
                .unwrap();
            w.extend([1.0, 2.0]).unwrap();
            w.finish().unwrap();
            b
        };
        let c_order = f64s(npyz::Order::C);
        assert!(matches!(read_npy(&c_order[..]).unwrap().1, Data::Other(d) if d == "numpy <f8"));
        let fortran = f64s(npyz::Order::Fortran);
        assert!(read_npy(&fortran[..]).unwrap_err().contains("Fortran"));
        // Big-endian f4, as numpy writes it with dtype '>f4': the same values.
        let mut big = Vec::new();
        let mut w = npyz::WriteOptions::<f32>::new()
            .dtype(npyz::DType::Plain(">f4".parse().unwrap()))
            .shape(&[2])
            .writer(&mut big)
            .begin_nd()
            .unwrap();
        w.extend([1.5f32, -3.0]).unwrap();
        w.finish().unwrap();
        assert!(matches!(read_npy(&big[..]).unwrap().1, Data::F32(v) if v == [1.5, -3.0]));
        let full = npy_bytes(&Data::F32(vec![0.0; 100]), &[100]);
        let cut = read_npy(&full[..full.len() - 8]).unwrap_err();
        assert!(cut.contains("cannot read the data"), "{cut}");
        assert!(read_npy(&b"PK\x03\x04 not npy"[..]).is_err());
    }
}
