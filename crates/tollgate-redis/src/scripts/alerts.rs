//! The alerts family (`lua/alerts/`): the due set and each subject's outbox
//! (see each script's header and `tollgate_redis::alerts`).

eval_scripts!(static ALERT_EVAL in "alerts" {
    ALERT_TAKE = "alert_take" clock;
    ALERT_LEASE = "alert_lease" clock;
    ALERT_DONE = "alert_done" clock;
    ALERT_POINT = "alert_point";
});
