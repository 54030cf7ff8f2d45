//! The sessions family (`lua/sessions/`): the dashboard's login sessions.

eval_scripts!(static SESSION_EVAL in "sessions" {
    SESSION_OPEN = "session_open" clock;
    SESSION_TOUCH = "session_touch" clock;
});

/// `session_open.lua`
pub fn session_open<'a>(
    key: &str,
    session: &tollgate_core::session::NewSession,
    lifetime_ms: u64,
    idle_ms: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = SESSION_OPEN.prepare_invoke();
    inv.key(key)
        .arg(session.role.as_str())
        .arg(&session.csrf)
        .arg(&session.credential)
        .arg(lifetime_ms)
        .arg(idle_ms);
    inv
}

/// `session_touch.lua`
pub fn session_touch<'a>(key: &str, idle_ms: u64) -> redis::ScriptInvocation<'a> {
    let mut inv = SESSION_TOUCH.prepare_invoke();
    inv.key(key).arg(idle_ms);
    inv
}
