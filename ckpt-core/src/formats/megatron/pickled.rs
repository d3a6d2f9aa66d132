//! What Megatron's pickles may hold, shared by its rank files and the distributed
//! optimizer's: the globals allowed beyond torch's tensor machinery, and the fields of
//! the pickled `argparse.Namespace` (`args`).

use crate::error::{Error, Result};
use crate::formats::pickle::Value;
use crate::formats::torch_save::{self, Archive};

/// The object of a torch.save archive (`common.pt`, a pickled ShardedObject), read with
/// the globals Megatron's pickles may name ([`allowed`]); nothing is imported or run.
///
/// # Errors
/// Not a torch.save archive; a global outside the list.
pub(crate) fn object(all: &[u8]) -> Result<Value> {
    let obj = Archive::open(all).and_then(|a| a.object())?;
    let mut names = Vec::new();
    obj.globals(&mut names);
    if let Some((m, n)) = names.into_iter().find(|(m, n)| !allowed(m, n)) {
        return Err(Error::InvalidTorch {
            problem: format!("data.pkl names the global `{m}.{n}`"),
        });
    }
    Ok(obj)
}

/// The Namespace's fields: `Build { object: Namespace(), state: {..} }`.
pub(crate) fn namespace_fields(v: &Value) -> Option<&[(Value, Value)]> {
    match v {
        Value::Build { object, state } => {
            let ((m, n), _) = object.call_of()?;
            if (m, n) != ("argparse", "Namespace") {
                return None;
            }
            match state.as_ref() {
                Value::Dict(kv) => Some(kv),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The globals a rank file may name beyond torch's tensor machinery.
pub(crate) fn allowed(module: &str, name: &str) -> bool {
    torch_save::allowed(module, name)
        || matches!(
            (module, name),
            ("argparse", "Namespace")
                | ("_codecs", "encode")
                | ("numpy", "ndarray")
                | ("numpy", "dtype")
                | ("numpy.core.multiarray", "_reconstruct")
                | ("numpy._core.multiarray", "_reconstruct")
                | ("numpy.core.multiarray", "scalar")
                | ("numpy._core.multiarray", "scalar")
                | ("torch", "Size")
                | ("builtins", "set")
                | ("builtins", "frozenset")
                | ("builtins", "slice")
        )
        // torch's dtypes (args.params_dtype) and megatron's enums (args.attention_backend).
        || (module == "torch" && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        || (module.starts_with("megatron.core.") && name.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
}
