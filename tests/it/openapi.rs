//! The OpenAPI document checked by a real validator (openapi-spec-validator,
//! which scripts/test installs into target/test-tools), not only by our own
//! structural checks in `api.rs`.

use std::process::Command;
use std::sync::Arc;

use tollgate_api::state::{ApiState, Settings};
use tollgate_core::config::Config;

/// The Python that has openapi-spec-validator: `TOLLGATE_TEST_PYTHON` (set by
/// scripts/test), else `python3`.
fn python() -> String {
    std::env::var("TOLLGATE_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn openapi_document_passes_openapi_spec_validator() {
    let backends = tollgate_memory::backends(Arc::new(Config::builtin()));
    let state = ApiState::new(&backends, Settings::default());
    let doc = tollgate_api::openapi(&state);
    let path = std::env::temp_dir().join(format!(
        "tollgate-openapi-{}.json",
        tollgate_tests::random_prefix()
    ));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    let script = "import json, sys\n\
                  from openapi_spec_validator import validate\n\
                  validate(json.load(open(sys.argv[1])))\n\
                  print('valid')";
    let out = Command::new(python())
        .args(["-c", script])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}; run scripts/test, which sets up a Python with openapi-spec-validator", python()));
    let _ = std::fs::remove_file(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openapi_spec_validator'"),
        "openapi-spec-validator is not installed for {}: run scripts/test (it installs it into \
         target/test-tools) or `pip install openapi-spec-validator`",
        python()
    );
    assert!(
        out.status.success(),
        "the OpenAPI document is invalid:\n{stderr}"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "valid");
}
