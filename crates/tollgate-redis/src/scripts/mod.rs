//! The Lua scripts of `lua/`, embedded at build time: one module per script
//! family (budget, jobs, throttle, activity, alerts, sessions, streams), each
//! beside its folder `lua/<family>/`, holding the family's declaration, its
//! typed calls (each owning its script's KEYS/ARGV order) and its replies'
//! decoders. [`reply`] reads the values every family's replies are made of.
//!
//! A family with a shared prelude is one function library ([`Library`],
//! `FUNCTION LOAD`, called by `FCALL`), declared with [`library!`]: its prelude
//! (`lua/<family>/lib/*.lua`) runs once when Redis loads it, not on every call.
//! The others are scripts ([`eval_scripts!`]): `redis::Script` sends EVALSHA
//! and, on NOSCRIPT (a restarted or flushed Redis), loads the script and
//! retries. Either way a script is named once, by its file.

use redis::{Cmd, RedisError, RedisResult, Script};

/// Declares a function library: `static NAME` (its [`Library`]) and `const
/// LIST` (its scripts by file name), from the prelude's parts in
/// `lua/<family>/lib/` (in order: one Lua chunk) and the scripts in
/// `lua/<family>/`, each named once.
macro_rules! library {
    (
        $(#[$doc:meta])*
        static $name:ident, const $list:ident = $library:literal in $family:literal {
            prelude: [$($part:literal),* $(,)?],
            $(finish: $finish:literal,)?
            scripts: [$($script:literal),* $(,)?] $(,)?
        }
    ) => {
        $(#[$doc])*
        pub static $name: std::sync::LazyLock<$crate::scripts::Library> =
            std::sync::LazyLock::new(|| {
                let prelude = [$(include_str!(concat!(
                    env!("CARGO_MANIFEST_DIR"), "/../../lua/", $family, "/lib/", $part, ".lua"
                ))),*]
                .join("\n");
                let finish: Option<&str> = None $(.or(Some($finish)))?;
                $crate::scripts::Library::build(
                    $library,
                    ($family, &[$($part),*], &prelude),
                    &[$((
                        $script,
                        include_str!(concat!(
                            env!("CARGO_MANIFEST_DIR"), "/../../lua/", $family, "/", $script, ".lua"
                        )),
                    )),*],
                    finish,
                )
            });

        #[doc = concat!("The scripts of [`", stringify!($name), "`], by their file in `lua/", $family, "/`.")]
        pub const $list: &[&str] = &[$($script),*];
    };
}

/// Declares scripts sent by EVALSHA: one `static` per script (a
/// `redis::Script`, its file in `lua/<family>/`, after `lua/clock.lua` when
/// marked `clock`), and `static LIST`, every one by its file's name.
macro_rules! eval_scripts {
    (static $list:ident in $family:literal { $($name:ident = $file:literal $($clock:ident)?;)* }) => {
        $(
            #[doc = concat!("`lua/", $family, "/", $file, ".lua`.")]
            pub static $name: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
                $crate::scripts::script(
                    include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lua/", $family, "/", $file, ".lua")),
                    eval_scripts!(@clock $($clock)?),
                )
            });
        )*

        #[doc = concat!("The EVALSHA scripts of `lua/", $family, "/`, by their file's name.")]
        pub static $list: &[(&str, &std::sync::LazyLock<redis::Script>)] = &[$((concat!($file, ".lua"), &$name)),*];
    };
    (@clock clock) => { true };
    (@clock) => { false };
}

pub mod activity;
pub mod alerts;
pub mod budget;
pub mod jobs;
pub mod reply;
pub mod sessions;
pub mod streams;
pub mod throttle;

pub use activity::*;
pub use alerts::*;
pub use budget::*;
pub use jobs::*;
pub use sessions::*;
pub use streams::*;
pub use throttle::*;

/// A Redis function library: a shared Lua prelude, then one function per
/// script, each script's text the body of its function (called with the
/// prelude's `begin(keys, args)` first, which resets the per-call state).
///
/// The library and its functions are named after a version, the first 16 hex
/// digits of the SHA-1 of the prelude and the scripts
/// (`tollgate_<name>_<version>`, `tollgate_<name>_<version>_<script>`), so
/// that builds of different code coexist on one Redis during a rolling
/// upgrade. Redis keeps functions in its data set: they survive a restart with
/// persistence and reach replicas, so a failover keeps them. A Redis without
/// the library (new, flushed, a new cluster node) answers `FCALL` with
/// "Function not found" without running anything; [`FunctionCall`] then
/// loads the library (`FUNCTION LOAD`, sent to every primary of a
/// cluster) and calls again.
#[derive(Debug)]
pub struct Library {
    name: String,
    text: String,
    prefix: String,
    /// Its folder in `lua/` and its prelude's parts (`lua/<family>/lib/`).
    family: &'static str,
    parts: &'static [&'static str],
}

impl Library {
    /// `scripts`: (name, body) per function; `finish`: a function of the
    /// prelude each reply passes through (the budget library's: it wraps a
    /// reply whose caller must add an alert pointer). Declared with
    /// [`library!`].
    pub(crate) fn build(
        name: &str,
        (family, part_names, prelude): (&'static str, &'static [&'static str], &str),
        scripts: &[(&str, &str)],
        finish: Option<&str>,
    ) -> Self {
        let mut parts = prelude.to_owned();
        for (script, body) in scripts {
            parts.push('\0');
            parts.push_str(script);
            parts.push('\0');
            parts.push_str(body);
        }
        let hash = Script::new(&parts).get_hash().to_owned();
        let version = &hash[..16];
        let library = format!("tollgate_{name}_{version}");
        let prefix = format!("{library}_");
        let mut text = format!("#!lua name={library}\n{prelude}");
        for (script, body) in scripts {
            let body = match finish {
                Some(f) => format!("return {f}((function()\n{body}\nend)())"),
                None => (*body).to_owned(),
            };
            text.push_str(&format!(
                "\nredis.register_function('{prefix}{script}', function(keys, args)\n\
                 begin(keys, args)\n{body}\nend)\n"
            ));
        }
        Self {
            name: library,
            text,
            prefix,
            family,
            parts: part_names,
        }
    }

    /// Its folder in `lua/`.
    pub fn family(&self) -> &'static str {
        self.family
    }

    /// Its prelude's parts, in order (`lua/<family>/lib/<part>.lua`).
    pub fn prelude_parts(&self) -> &'static [&'static str] {
        self.parts
    }

    /// The library's name (`FUNCTION LIST LIBRARYNAME`, `FUNCTION DELETE`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The full name of one script's function.
    pub fn function(&self, script: &str) -> String {
        format!("{}{script}", self.prefix)
    }

    /// `FUNCTION LOAD <library>` (on every primary of a cluster), without
    /// `REPLACE`: a Redis that has this version answers "already exists"
    /// before compiling anything. The name is the version, a hash of the
    /// code, so a library of that name is this code: never worth replacing.
    pub fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&self.text);
        cmd
    }

    /// Loads the library on `conn`'s server where it is missing ("already
    /// exists" is success). After a flush, the pods whose calls all found
    /// the function missing at once compile it once, not once each: every
    /// compile holds Redis (~4–6 ms for the budget library).
    pub async fn load_async(&self, conn: &mut impl redis::aio::ConnectionLike) -> RedisResult<()> {
        match self.load_cmd().query_async::<redis::Value>(conn).await {
            Ok(_) => Ok(()),
            Err(e) if already_loaded(&e.to_string()) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A call of `script`'s function: add its keys and args, then send it.
    pub fn prepare(&'static self, script: &str) -> FunctionCall {
        FunctionCall {
            library: self,
            function: self.function(script),
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// Loads the function libraries (budget, job, throttle) on `pool`'s Redis (every
/// primary of a cluster) where it lacks this build's version: a process
/// does it as it connects, so that no call waits for Redis to compile a
/// library (a first call on a new version would otherwise pay for it, and a
/// grant's use-by shrinks by the time its call took). Best effort: a Redis
/// that refuses (an ACL without `FUNCTION`) loads on the first call's
/// "Function not found" as before.
pub async fn preload(pool: &crate::pool::Pool, timeout: std::time::Duration) {
    for (library, _) in libraries() {
        let cmd = library.load_cmd();
        match crate::call::command::<redis::Value>(pool, timeout, "function_load", &cmd).await {
            Ok(_) => {}
            Err(e) if already_loaded(&e.to_string()) => {}
            Err(e) => {
                tracing::debug!(library = library.name(), error = %e, "function library not preloaded: the first call loads it");
            }
        }
    }
}

/// Whether an error's text is Redis answering a `FUNCTION LOAD` (without
/// `REPLACE`) that it has this library already: the load's goal holds.
fn already_loaded(message: &str) -> bool {
    message.contains("already exists")
}

/// Whether Redis answered that it has no such function (the library is not
/// loaded there): the call did not run.
pub fn is_missing_function(e: &RedisError) -> bool {
    e.code() == Some("ERR") && e.to_string().contains("Function not found")
}

/// Whether Redis answered that it has no such script (`NOSCRIPT`: flushed,
/// or never loaded there): the call did not run.
pub fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// One `FCALL` of a [`Library`]'s function.
#[derive(Debug, Clone)]
pub struct FunctionCall {
    library: &'static Library,
    function: String,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl FunctionCall {
    pub fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    pub fn library(&self) -> &'static Library {
        self.library
    }

    /// The bare `FCALL` (for a pipeline, which does not load the library on
    /// "Function not found": load it on the server first).
    pub fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.function).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a);
        }
        cmd
    }

    /// `FCALL`; on "Function not found", loads the library and calls again,
    /// up to `loads` loads (a library flushed again between its load and the
    /// call). The error answers "Function not found" ran nothing, so this
    /// never runs the function twice.
    pub async fn invoke_async<T: redis::FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
        loads: usize,
    ) -> RedisResult<T> {
        let cmd = self.cmd();
        let mut loaded = 0;
        loop {
            match cmd.query_async::<T>(conn).await {
                Err(e) if is_missing_function(&e) && loaded < loads => {
                    loaded += 1;
                    self.library.load_async(conn).await?;
                }
                done => return done,
            }
        }
    }
}

const CLOCK_LIB: &str = include_str!("../../../../lua/clock.lua");

/// A script sent by EVALSHA: `body`, after `lua/clock.lua` when it needs the
/// time (`clock`).
fn script(body: &str, clock: bool) -> Script {
    if clock {
        Script::new(&format!("{CLOCK_LIB}\n{body}"))
    } else {
        Script::new(body)
    }
}

/// Every script called by EVALSHA, by the name of its file in `lua/`: what the
/// cluster audit checks ran on the suite's Redis Cluster (`tollgate-bench
/// cluster-audit`). The function libraries' scripts are [`LIBRARIES`].
pub fn all() -> Vec<(&'static str, &'static Script)> {
    [
        JOB_EVAL,
        ACTIVITY_EVAL,
        SESSION_EVAL,
        STREAM_EVAL,
        ALERT_EVAL,
        BUDGET_EVAL,
    ]
    .into_iter()
    .flatten()
    .map(|(name, script)| (*name, &***script))
    .collect()
}

/// The function libraries with their scripts (see [`library!`]).
pub fn libraries() -> [(&'static Library, &'static [&'static str]); 3] {
    [
        (&BUDGET, BUDGET_SCRIPTS),
        (&JOBS, JOB_SCRIPTS),
        (&THROTTLE, THROTTLE_SCRIPTS),
    ]
}

#[cfg(test)]
mod tests {
    /// A script added to `lua/<family>/` and left out of its family's
    /// declaration would escape the cluster audit.
    #[test]
    fn every_script_file_is_listed() {
        let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lua"));
        let mut files = Vec::new();
        for family in std::fs::read_dir(dir).expect("lua/").filter_map(|e| e.ok()) {
            if !family.path().is_dir() {
                continue;
            }
            for e in std::fs::read_dir(family.path())
                .expect("family")
                .filter_map(|e| e.ok())
            {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".lua") {
                    files.push(name);
                }
            }
        }
        files.sort();
        let mut listed: Vec<String> = super::all().iter().map(|(n, _)| (*n).to_owned()).collect();
        for (_, scripts) in super::libraries() {
            listed.extend(scripts.iter().map(|n| format!("{n}.lua")));
        }
        listed.sort();
        assert_eq!(
            files, listed,
            "lua/<family>/*.lua and the declarations differ"
        );
    }
}
